package kvroute

import (
	"bytes"
	"encoding/json"
	"testing"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// FuzzLegBodies feeds client bodies of every API to request parsing, the
// prefill and decode leg rewrites and ContinuationKeys. Bodies are
// untrusted: nothing may panic, and a body that parses must give legs
// that an independent decoder (encoding/json; like vLLM's parser, the last
// of duplicate keys wins) reads as the rewrite intends: the prefill leg
// without the members it drops, with the members it sets and the handle,
// the decode leg with P's handle and without the members it drops.
func FuzzLegBodies(f *testing.F) {
	paths := []string{PathChatCompletions, PathCompletions, PathResponses, PathMessages}
	for i, s := range []string{
		`{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,"max_tokens":9}`,
		`{"model":"m","messages":[{"role":"system","content":"s"},{"role":"user","content":[{"type":"text","text":"a"}]},{"role":"assistant","content":"b","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}}]},{"role":"tool","tool_call_id":"c","content":"r"}],"stream":1,"stream_options":{"include_usage":true},"stop":["x"],"n":1}`,
		`{"model":"m","prompt":"Once","max_tokens":5,"stream":"true","stop_token_ids":[2],"kv_transfer_params":{"x":1}}`,
		`{"model":"m","prompt":[1,2,3],"min_tokens":1,"max_tokens":4,"str\u0065am":true,"stream":false}`,
		`{"model":"m","input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]}],"stream":true,"store":false,"max_output_tokens":64,"prompt_cache_key":"s"}`,
		`{"model":"m","system":[{"type":"text","text":"s","cache_control":{"type":"ephemeral"}}],"messages":[{"role":"user","content":"hi"}],"max_tokens":32000,"stream":true,"thinking":{"type":"adaptive"}}`,
		`{"a":1,"a":2}`, `[]`, `{"messages":null}`, `{"model":7}`,
	} {
		f.Add(uint8(i), []byte(s))
	}
	pHandle := []byte(`{"do_remote_prefill":true,"remote_block_ids":[1,2],"remote_engine_id":"p","remote_host":"h","remote_port":1}`)
	retained := []byte(`{"do_remote_decode":true,"do_remote_prefill":false}`)
	f.Fuzz(func(t *testing.T, which uint8, body []byte) {
		req := &Request{Path: paths[int(which)%len(paths)], Body: body}
		if err := req.parse(Defaults().Limits.ObjectMembers); err != nil {
			return
		}
		leg := decodeJSON(t, "prefill", bytes.Join(prefillBody(req, retained, false), nil))
		for _, k := range req.api.prefillDrop {
			if _, ok := leg[k]; ok && k != kvKey {
				t.Fatalf("prefill leg keeps %q: %s", k, body)
			}
		}
		for _, m := range req.api.prefillSet {
			if !jsonEqual(leg[m.Key], m.Value) {
				t.Fatalf("prefill leg %q = %s, want %s: %s", m.Key, leg[m.Key], m.Value, body)
			}
		}
		if !jsonEqual(leg[kvKey], retained) {
			t.Fatalf("prefill leg handle = %s: %s", leg[kvKey], body)
		}

		// The default verification asks D for token ids where the API
		// returns them.
		leg = decodeJSON(t, "decode", bytes.Join(newDecodeLeg(req, pHandle, req.api.tokenIDs, nil).body, nil))
		if !jsonEqual(leg[kvKey], pHandle) {
			t.Fatalf("decode leg handle = %s: %s", leg[kvKey], body)
		}
		for _, k := range decodeDrop {
			if _, ok := leg[k]; ok && k != kvKey {
				t.Fatalf("decode leg keeps %q: %s", k, body)
			}
		}
		// A buffered stream's decode leg (buffered.go) is the same leg,
		// non-streaming and without stream_options.
		buffered := decodeJSON(t, "buffered decode", bytes.Join(newDecodeLeg(req, pHandle, req.api.tokenIDs, &buffered{}).body, nil))
		if !jsonEqual(buffered["stream"], jsonFalse) {
			t.Fatalf("buffered decode leg stream = %s: %s", buffered["stream"], body)
		}
		if _, ok := buffered["stream_options"]; ok {
			t.Fatalf("buffered decode leg keeps stream_options: %s", body)
		}
		delete(leg, "stream")
		delete(leg, "stream_options")
		delete(buffered, "stream")
		if len(leg) != len(buffered) {
			t.Fatalf("buffered decode leg differs: %d members, want %d: %s", len(buffered), len(leg), body)
		}
		for k, v := range leg {
			if !jsonEqual(buffered[k], v) {
				t.Fatalf("buffered decode leg %q = %s, want %s: %s", k, buffered[k], v, body)
			}
		}

		var ck ContinuationKeys
		c, err := ck.Lookup(req)
		if err != nil {
			return
		}
		reply := &Reply{Content: "ok", FinishReason: "stop"}
		a, errA := ck.Key(req, c, reply)
		b, errB := ck.Key(req, Candidates{}, reply)
		if (errA == nil) != (errB == nil) || a.Key != b.Key || !bytes.Equal(a.Check, b.Check) || a.Refusal != b.Refusal {
			t.Fatalf("Key with Lookup's memo %+v (%v) differs from Key alone %+v (%v): %s", a, errA, b, errB, body)
		}
		_ = ck.Verify(req, c, a.Check)
	})
}

func decodeJSON(t *testing.T, leg string, b []byte) map[string]json.RawMessage {
	t.Helper()
	if _, err := jsonraw.Parse(b); err != nil {
		t.Fatalf("%s leg is not a JSON object (jsonraw): %v: %s", leg, err, b)
	}
	var m map[string]json.RawMessage
	if err := json.Unmarshal(b, &m); err != nil {
		t.Fatalf("%s leg is not a JSON object (encoding/json): %v: %s", leg, err, b)
	}
	return m
}

func jsonEqual(a, b []byte) bool {
	var x, y any
	return json.Unmarshal(a, &x) == nil && json.Unmarshal(b, &y) == nil && bytes.Equal(mustMarshal(x), mustMarshal(y))
}

func mustMarshal(v any) []byte {
	b, _ := json.Marshal(v)
	return b
}
