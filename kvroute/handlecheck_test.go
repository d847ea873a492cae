package kvroute_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// handleFront stands in front of an engine and rewrites the
// kv_transfer_params of its answers, in bodies and in stream events, with
// rewrite (nil: as they are): an engine whose handles are malformed.
type handleFront struct {
	target  string
	rewrite func(h []byte) []byte
}

func (f *handleFront) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	req, err := http.NewRequestWithContext(r.Context(), r.Method, f.target+r.URL.RequestURI(), bytes.NewReader(b))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	for k, v := range resp.Header {
		if k != "Content-Length" {
			w.Header()[k] = v
		}
	}
	w.WriteHeader(resp.StatusCode)
	if !strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream") {
		out, _ := io.ReadAll(resp.Body)
		_, _ = w.Write(f.apply(out))
		return
	}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		line := sc.Bytes()
		if data, ok := bytes.CutPrefix(line, []byte("data: ")); ok {
			line = append([]byte("data: "), f.apply(data)...)
		}
		_, _ = w.Write(append(line, '\n'))
		if len(sc.Bytes()) == 0 {
			http.NewResponseController(w).Flush()
		}
	}
}

// apply rewrites the top-level kv_transfer_params of a JSON object.
func (f *handleFront) apply(b []byte) []byte {
	if f.rewrite == nil {
		return b
	}
	var m map[string]json.RawMessage
	if json.Unmarshal(b, &m) != nil {
		return b
	}
	h, ok := m["kv_transfer_params"]
	if !ok || string(h) == "null" {
		return b
	}
	return bytes.Replace(b, h, f.rewrite(h), 1)
}

// setMember returns handle h with member key set to the raw JSON v.
func setMember(h []byte, key, v string) []byte {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(h, &m); err != nil {
		panic(err)
	}
	m[key] = json.RawMessage(v)
	out, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return out
}

// setBlock returns h with the first block id of its first KV group
// replaced by the raw JSON v.
func setBlock(h []byte, v string) []byte {
	var m struct {
		Blocks [][]json.RawMessage `json:"remote_block_ids"`
	}
	if err := json.Unmarshal(h, &m); err != nil {
		panic(err)
	}
	m.Blocks[0][0] = json.RawMessage(v)
	b, err := json.Marshal(m.Blocks)
	if err != nil {
		panic(err)
	}
	return setMember(h, "remote_block_ids", string(b))
}

// appendMember returns h with raw text (`,"key":value`) added before its
// closing brace: a member named twice.
func appendMember(h []byte, raw string) []byte {
	i := bytes.LastIndexByte(h, '}')
	return append(append(append([]byte(nil), h[:i]...), raw...), h[i:]...)
}

// invalidHandleVariants are handles vLLM cannot read correctly, made from
// an engine's valid one.
var invalidHandleVariants = []struct {
	name    string
	rewrite func(h []byte) []byte
}{
	{"block id 1e999", func(h []byte) []byte { return setBlock(h, "1e999") }},
	{"block id 2^64", func(h []byte) []byte { return setBlock(h, "18446744073709551616") }},
	{"block id 2^31", func(h []byte) []byte { return setBlock(h, "2147483648") }},
	{"block id -1", func(h []byte) []byte { return setBlock(h, "-1") }},
	{"block id 1.5", func(h []byte) []byte { return setBlock(h, "1.5") }},
	{"block id 2e1", func(h []byte) []byte { return setBlock(h, "2e1") }},
	{"block id string", func(h []byte) []byte { return setBlock(h, `"7"`) }},
	{"block id null", func(h []byte) []byte { return setBlock(h, "null") }},
	{"block id list", func(h []byte) []byte { return setBlock(h, "[7]") }},
	{"blocks object", func(h []byte) []byte { return setMember(h, "remote_block_ids", `{"0":[1,2]}`) }},
	{"blocks mixed", func(h []byte) []byte { return setMember(h, "remote_block_ids", `[[1,2],3]`) }},
	{"fewer blocks than tokens", func(h []byte) []byte { return setMember(h, "remote_block_ids", `[[1]]`) }},
	{"port 70000", func(h []byte) []byte { return setMember(h, "remote_port", "70000") }},
	{"port -1", func(h []byte) []byte { return setMember(h, "remote_port", "-1") }},
	{"port 0", func(h []byte) []byte { return setMember(h, "remote_port", "0") }},
	{"port string", func(h []byte) []byte { return setMember(h, "remote_port", `"5601"`) }},
	{"port float", func(h []byte) []byte { return setMember(h, "remote_port", "5601.0") }},
	{"port named twice", func(h []byte) []byte { return appendMember(h, `,"remote_port":70000`) }},
	{"port named twice escaped", func(h []byte) []byte { return appendMember(h, `,"\u0072emote_port":70000`) }},
	{"tokens -1", func(h []byte) []byte { return setMember(h, "remote_num_tokens", "-1") }},
	{"tokens 1e2", func(h []byte) []byte { return setMember(h, "remote_num_tokens", "1e2") }},
	{"tokens string", func(h []byte) []byte { return setMember(h, "remote_num_tokens", `"100"`) }},
	{"tokens 2^64", func(h []byte) []byte { return setMember(h, "remote_num_tokens", "18446744073709551616") }},
	{"engine id number", func(h []byte) []byte { return setMember(h, "remote_engine_id", "7") }},
	{"engine id empty", func(h []byte) []byte { return setMember(h, "remote_engine_id", `""`) }},
	{"host list", func(h []byte) []byte { return setMember(h, "remote_host", `["10.0.0.1"]`) }},
	{"request id object", func(h []byte) []byte { return setMember(h, "remote_request_id", `{}`) }},
	{"tp_size 0", func(h []byte) []byte { return setMember(h, "tp_size", "0") }},
	{"dcp_size string", func(h []byte) []byte { return setMember(h, "dcp_size", `"1"`) }},
	{"expiry 1e999", func(h []byte) []byte { return setMember(h, "remote_blocks_expiry_time", "1e999") }},
	{"expiry string", func(h []byte) []byte { return setMember(h, "remote_blocks_expiry_time", `"soon"`) }},
	{"role flag string", func(h []byte) []byte { return setMember(h, "do_remote_decode", `"true"`) }},
	{"transfer mode number", func(h []byte) []byte { return setMember(h, "transfer_mode", "1") }},
}

// attachedHandles returns the kv_transfer_params of the prefill legs an
// engine served that carried a retained handle to read (not the miss
// handle, nor a release: remote_num_tokens 0 reads nothing).
func attachedHandles(t *testing.T, e *kvroutetest.Engine) []string {
	t.Helper()
	var out []string
	for _, rec := range e.Requests() {
		if rec.Role != "prefill" {
			continue
		}
		var b struct {
			KV map[string]json.RawMessage `json:"kv_transfer_params"`
		}
		require.NoError(t, json.Unmarshal(rec.Body, &b))
		if id, ok := b.KV["remote_engine_id"]; ok && string(id) != "null" && string(b.KV["remote_num_tokens"]) != "0" {
			out = append(out, mustJSON(b.KV))
		}
	}
	return out
}

// Issue 21.9: a decode engine's handle that vLLM could not read correctly
// is never retained, so never attached; the turn after it is a plain miss
// with the single engine's answer.
func TestInvalidDecodeHandlesRefused(t *testing.T) {
	variants := append([]struct {
		name    string
		rewrite func(h []byte) []byte
	}{{"valid", nil}}, invalidHandleVariants...)
	for _, stream := range []bool{false, true} {
		for _, v := range variants {
			t.Run(fmt.Sprintf("%s stream=%v", v.name, stream), func(t *testing.T) {
				c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
				front := &handleFront{target: c.Decode[0].URL(), rewrite: v.rewrite}
				obs := &kvroutetest.Records{}
				r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(newServer(t, front)), kvroute.WithObserver(obs))
				require.NoError(t, err)
				t.Cleanup(func() { _ = r.Close() })
				url := serve(t, r)
				conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
				for i := range 2 {
					conv.say(userText(i))
					body := conv.body()
					res := post(t, url, conv.path, body, nil)
					require.Equal(t, http.StatusOK, res.status, "turn %d: %s", i, res.raw)
					assert.Equal(t, reference(t, conv.path, body), res.text, "turn %d", i)
					conv.hear(res.text)
					if i == 0 && v.rewrite != nil {
						assert.Equal(t, kvroute.RefuseInvalidHandle, obs.Last().StoreRefusal)
						assert.False(t, obs.Last().Stored)
					}
				}
				attached := attachedHandles(t, c.Prefill[0])
				if v.rewrite == nil {
					assert.Equal(t, kvroute.ReuseHit, obs.Last().Reuse, "the valid handle is reused")
					assert.Len(t, attached, 1)
					assert.Zero(t, r.Stats().InvalidHandles)
					return
				}
				assert.Empty(t, attached, "an invalid handle reached a prefill engine")
				assert.Equal(t, kvroute.MissNotFound, obs.Last().MissReason)
				assert.Equal(t, int64(2), r.Stats().InvalidHandles, "one per turn")
				for _, e := range append(c.Prefill, c.Decode...) {
					st := e.Stats()
					assert.Zero(t, st.AssertFailures+st.LoadFailures+st.FreedReads+st.WrongOutputs+st.PoisonedHits, "%+v", st)
				}
			})
		}
	}
}

// Issue 21.9: a prefill engine's handle that vLLM could not read correctly
// never reaches a decode engine: the turn fails as if P gave no handle.
// One with fewer blocks than its engine's block size needs (read from the
// engine's /metrics) is not a failure of the turn: the decode engine
// prefills by itself, a plain request (issue 29.1).
func TestInvalidPrefillHandlesRefused(t *testing.T) {
	for _, v := range invalidHandleVariants {
		t.Run(v.name, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1)
			front := &handleFront{target: c.Prefill[0].URL(), rewrite: v.rewrite}
			r, err := kvroute.New(kvroute.WithPrefill(newServer(t, front)), kvroute.WithDecode(c.Decode[0].URL()))
			require.NoError(t, err)
			t.Cleanup(func() { _ = r.Close() })
			url := serve(t, r)
			body := chatBody(false, systemPrompt)
			res := send(t, url, kvroute.PathChatCompletions, body, nil)
			assert.Equal(t, int64(1), r.Stats().InvalidHandles)
			if v.name == "fewer blocks than tokens" {
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
				assert.Equal(t, int64(1), r.Stats().UnvalidatedHandles)
				for _, rec := range c.Decode[0].Requests() {
					assert.Equal(t, "plain", rec.Role, "the decode engine got the handle")
				}
				return
			}
			assert.Equal(t, http.StatusBadGateway, res.status, "%s", res.raw)
			assert.Zero(t, c.Decode[0].Stats().Requests, "the decode engine got the invalid handle")
			assert.Zero(t, r.Stats().UnvalidatedHandles)
		})
	}
}
