package kvroute_test

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// fakeEngine is a tiny engine for shapes the simulator does not produce. A
// request whose kv_transfer_params has do_remote_decode true is a prefill
// leg; any other is a decode leg.
type fakeEngine struct {
	t       testing.TB
	url     string
	prefill func(w http.ResponseWriter, body map[string]json.RawMessage)
	decode  func(w http.ResponseWriter, body map[string]json.RawMessage)

	mu   sync.Mutex
	reqs []fakeRequest
}

type fakeRequest struct {
	role      string
	requestID string
	body      map[string]json.RawMessage
}

func newFake(t testing.TB) *fakeEngine {
	f := &fakeEngine{t: t}
	f.prefill = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
		writeJSON(w, prefillAnswer(testPHandle, ""))
	}
	f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
		writeJSON(w, decodeAnswer("hello", testDHandle))
	}
	f.url = newServer(t, http.HandlerFunc(f.serve))
	return f
}

func (f *fakeEngine) serve(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	var body map[string]json.RawMessage
	if err := json.Unmarshal(b, &body); err != nil {
		http.Error(w, "bad json", http.StatusBadRequest)
		return
	}
	role := "decode"
	var kv struct {
		DoRemoteDecode bool `json:"do_remote_decode"`
	}
	if raw, ok := body["kv_transfer_params"]; ok && json.Unmarshal(raw, &kv) == nil && kv.DoRemoteDecode {
		role = "prefill"
	}
	if r.Header.Get("User-Agent") == "bidikv-release" {
		role = "release" // a release request, answered as a prefill leg
	}
	f.mu.Lock()
	f.reqs = append(f.reqs, fakeRequest{role: role, requestID: r.Header.Get("X-Request-Id"), body: body})
	f.mu.Unlock()
	if role != "decode" {
		f.prefill(w, body)
	} else {
		f.decode(w, body)
	}
}

// requests returns the turns' requests in order (release requests, sent
// in the background, aside).
func (f *fakeEngine) requests() []fakeRequest {
	f.mu.Lock()
	defer f.mu.Unlock()
	var out []fakeRequest
	for _, r := range f.reqs {
		if r.role != "release" {
			out = append(out, r)
		}
	}
	return out
}

const (
	testPHandle = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],"remote_engine_id":"p0","remote_request_id":"r","remote_host":"10.0.0.1","remote_port":5600,"tp_size":1}`
	testDHandle = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[7,8,9,10,11,12,13]],"remote_engine_id":"d0","remote_request_id":"rd","remote_host":"10.0.0.2","remote_port":5601,"tp_size":1,"remote_num_tokens":100}`
)

func writeJSON(w http.ResponseWriter, body string) {
	w.Header().Set("Content-Type", "application/json")
	_, _ = io.WriteString(w, body)
}

// prefillAnswer is P's answer with handle (none when "") and a usage
// member (none when "").
func prefillAnswer(handle, usage string) string {
	s := `{"id":"p","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}]`
	if usage != "" {
		s += `,"usage":` + usage
	}
	if handle != "" {
		s += `,"kv_transfer_params":` + handle
	}
	return s + "}"
}

func decodeAnswer(content, handle string) string {
	s := `{"id":"d","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":` + mustJSON(content) + `},"finish_reason":"stop"}]`
	if handle != "" {
		s += `,"kv_transfer_params":` + handle
	}
	return s + "}"
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

// streamAnswer writes a chat stream of content whose final chunk carries
// handle (none when "").
func streamAnswer(w http.ResponseWriter, content, handle string) {
	w.Header().Set("Content-Type", "text/event-stream")
	fmt.Fprintf(w, "data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":%s},\"finish_reason\":null}]}\n\n", mustJSON(content))
	final := `{"id":"d","choices":[{"index":0,"delta":{},"finish_reason":"stop"}]`
	if handle != "" {
		final += `,"kv_transfer_params":` + handle
	}
	fmt.Fprintf(w, "data: %s}\n\ndata: [DONE]\n\n", final)
}

// fakeRouter is a router over one fake engine that serves both legs, in
// content verification (the fake sends no token ids) with no threshold.
func fakeRouter(t testing.TB, f *fakeEngine, obs *kvroutetest.Records, opts ...kvroute.Option) *kvroute.Router {
	t.Helper()
	base := []kvroute.Option{kvroute.WithPrefill(f.url), kvroute.WithDecode(f.url), kvroute.WithObserver(obs),
		kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent}), kvroute.WithThreshold(0)}
	r, err := kvroute.New(append(base, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func chatBody(stream bool, msgs ...string) []byte {
	var ms []message
	for i, m := range msgs {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		ms = append(ms, message{Role: role, Content: m})
	}
	return []byte(mustJSON(map[string]any{"model": kvroutetest.DefaultModel, "messages": ms, "max_tokens": 16, "stream": stream}))
}

// doTurn runs one turn through Do and reads it whole.
func doTurn(t testing.TB, r *kvroute.Router, body []byte, header http.Header) ([]byte, error) {
	t.Helper()
	if header == nil {
		header = http.Header{}
	}
	resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: header, Body: body})
	if err != nil {
		return nil, err
	}
	defer resp.Close()
	var buf bytes.Buffer
	_, err = resp.WriteTo(&buf)
	return buf.Bytes(), err
}

// oldPrefill stands in front of a simulated prefill engine as an older
// engine: its answer carries no handle unless the request stops only on
// max_tokens (no stop, no stop_token_ids, ignore_eos true).
type oldPrefill struct {
	target string
	mu     sync.Mutex
	legs   []map[string]json.RawMessage
}

func (o *oldPrefill) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	b, _ := io.ReadAll(r.Body)
	req, _ := http.NewRequestWithContext(r.Context(), r.Method, o.target+r.URL.Path, bytes.NewReader(b))
	req.Header = r.Header.Clone()
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	defer resp.Body.Close()
	out, _ := io.ReadAll(resp.Body)
	var body map[string]json.RawMessage
	if json.Unmarshal(b, &body) == nil && body["kv_transfer_params"] != nil && r.URL.Path != "/tokenize" && !strings.HasSuffix(r.URL.Path, "/render") {
		o.mu.Lock()
		o.legs = append(o.legs, body)
		o.mu.Unlock()
		_, stop := body["stop"]
		_, stopIDs := body["stop_token_ids"]
		if stop || stopIDs || string(body["ignore_eos"]) != "true" {
			var ans map[string]json.RawMessage
			if json.Unmarshal(out, &ans) == nil {
				delete(ans, "kv_transfer_params")
				out, _ = json.Marshal(ans)
			}
		}
	}
	for k, v := range resp.Header {
		if k != "Content-Length" {
			w.Header()[k] = v
		}
	}
	w.WriteHeader(resp.StatusCode)
	_, _ = w.Write(out)
}

// Issue 12.1: a client stop string that matches P's first token must not
// leave an older prefill engine without a handle.
func TestPrefillLegFinishesOnLength(t *testing.T) {
	for _, stream := range []bool{false, true} {
		for _, path := range []string{kvroute.PathChatCompletions, kvroute.PathCompletions} {
			t.Run(fmt.Sprintf("%s stream=%v", path, stream), func(t *testing.T) {
				c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
				old := &oldPrefill{target: c.Prefill[0].URL()}
				obs := &kvroutetest.Records{}
				r, err := kvroute.New(kvroute.WithPrefill(newServer(t, old)), kvroute.WithDecode(c.Decode[0].URL()), kvroute.WithObserver(obs))
				require.NoError(t, err)
				t.Cleanup(func() { _ = r.Close() })
				url := serve(t, r)
				conv := &conversation{path: path, stream: stream, maxTok: 24}
				conv.say(systemPrompt)
				for i := range 3 {
					if i > 0 {
						conv.say(userText(i))
					}
					conv.extra = nil
					plain := reference(t, path, conv.body())
					require.NotEmpty(t, plain)
					// A stop string inside the reply's first token.
					conv.extra = map[string]any{"stop": []string{plain[:1]}}
					body := conv.body()
					want, err := kvroutetest.Reference(path, body)
					require.NoError(t, err)
					res := post(t, url, path, body, nil)
					require.Equal(t, http.StatusOK, res.status, "turn %d: %s", i, res.raw)
					assert.Equal(t, want.Text, res.text, "turn %d", i)
					assert.Equal(t, "stop", res.finish, "turn %d", i)
					conv.hear(res.text)
				}
				assert.Zero(t, r.Stats().NoPrefillHandle)
				old.mu.Lock()
				defer old.mu.Unlock()
				require.NotEmpty(t, old.legs)
				for _, leg := range old.legs {
					assert.NotContains(t, leg, "stop")
					assert.NotContains(t, leg, "stop_token_ids")
					assert.Equal(t, "true", string(leg["ignore_eos"]))
					assert.Equal(t, "1", string(leg["max_tokens"]))
				}
			})
		}
	}
}

// Issue 12.2: decode answers without a handle are counted per phase.
func TestNoDecodeHandleCounted(t *testing.T) {
	t.Run("non-streaming", func(t *testing.T) {
		f := newFake(t)
		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) { writeJSON(w, decodeAnswer("hello", "")) }
		obs := &kvroutetest.Records{}
		logs := &countHandler{}
		r := fakeRouter(t, f, obs, kvroute.WithLogger(slog.New(logs)))
		_, err := doTurn(t, r, chatBody(false, "hi"), nil)
		require.NoError(t, err)
		_, err = doTurn(t, r, chatBody(false, "hi again"), nil)
		require.NoError(t, err)
		assert.Equal(t, int32(1), logs.n.Load(), "warned once")
		assert.Equal(t, int64(2), r.Stats().NoDecodeHandle)
		assert.Equal(t, kvroute.PhaseDecode, obs.Last().NoHandle)
		assert.Equal(t, kvroute.RefuseNoHandle, obs.Last().StoreRefusal)
	})
	t.Run("stream of an engine that sends handles", func(t *testing.T) {
		f := newFake(t)
		var n atomic.Int32
		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
			h := testDHandle
			if n.Add(1) > 1 {
				h = "" // the second stream lost its handle
			}
			streamAnswer(w, "hello", h)
		}
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		_, err := doTurn(t, r, chatBody(true, "hi"), nil)
		require.NoError(t, err)
		assert.True(t, obs.Last().Stored)
		_, err = doTurn(t, r, chatBody(true, "another conversation"), nil)
		require.NoError(t, err)
		st := r.Stats()
		assert.Equal(t, int64(1), st.NoDecodeHandle)
		assert.Zero(t, st.NoStreamHandle)
		assert.Equal(t, kvroute.PhaseDecode, obs.Last().NoHandle)
	})
	t.Run("stock stream", func(t *testing.T) {
		f := newFake(t)
		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) { streamAnswer(w, "hello", "") }
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		_, err := doTurn(t, r, chatBody(true, "hi"), nil)
		require.NoError(t, err)
		st := r.Stats()
		assert.Zero(t, st.NoDecodeHandle)
		assert.Equal(t, int64(1), st.NoStreamHandle)
		assert.Equal(t, kvroute.Phase(""), obs.Last().NoHandle)
	})
	t.Run("prefill", func(t *testing.T) {
		f := newFake(t)
		f.prefill = func(w http.ResponseWriter, _ map[string]json.RawMessage) { writeJSON(w, prefillAnswer("", "")) }
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs, kvroute.WithFailover(kvroute.Failover{LocalPrefill: true}))
		_, err := doTurn(t, r, chatBody(false, "hi"), nil)
		require.NoError(t, err)
		st := r.Stats()
		assert.Equal(t, int64(1), st.NoPrefillHandle)
		assert.Zero(t, st.NoDecodeHandle, "D got no handle and owes none")
		assert.Equal(t, kvroute.PhasePrefill, obs.Last().NoHandle)
	})
}

// Issue 12.2: a hit whose prefill answer reports fewer cached tokens than
// were attached is counted; absent details are not checked.
func TestUnconfirmedHits(t *testing.T) {
	for _, tc := range []struct {
		name        string
		usage       string
		cached      int
		unconfirmed bool
	}{
		{"not read", `{"prompt_tokens":200,"prompt_tokens_details":{"cached_tokens":16}}`, 16, true},
		{"read", `{"prompt_tokens":200,"prompt_tokens_details":{"cached_tokens":99}}`, 99, false},
		{"whole prompt read but the last token", `{"prompt_tokens":80,"prompt_tokens_details":{"cached_tokens":79}}`, 79, false},
		{"no details", `{"prompt_tokens":200}`, -1, false},
		{"null details", `{"prompt_tokens":200,"prompt_tokens_details":null}`, -1, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t)
			f.prefill = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
				writeJSON(w, prefillAnswer(testPHandle, tc.usage))
			}
			obs := &kvroutetest.Records{}
			r := fakeRouter(t, f, obs)
			_, err := doTurn(t, r, chatBody(false, "hi"), nil)
			require.NoError(t, err)
			assert.False(t, obs.Last().Unconfirmed, "a miss attaches nothing")
			_, err = doTurn(t, r, chatBody(false, "hi", "hello", "more"), nil)
			require.NoError(t, err)
			rec := obs.Last()
			require.Equal(t, kvroute.ReuseHit, rec.Reuse, "%+v", rec)
			assert.Equal(t, tc.cached, rec.CachedTokens)
			assert.Equal(t, tc.unconfirmed, rec.Unconfirmed)
			want := int64(0)
			if tc.unconfirmed {
				want = 1
			}
			assert.Equal(t, want, r.Stats().UnconfirmedHits)
		})
	}
}

// Issue 12.2: push-mode handles are never retained nor passed to D.
func TestPushHandles(t *testing.T) {
	push := strings.Replace(testDHandle, `"tp_size":1`, `"tp_size":1,"transfer_mode":"push"`, 1)
	t.Run("decode", func(t *testing.T) {
		f := newFake(t)
		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) { writeJSON(w, decodeAnswer("hello", push)) }
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		_, err := doTurn(t, r, chatBody(false, "hi"), nil)
		require.NoError(t, err)
		assert.Equal(t, kvroute.RefusePushHandle, obs.Last().StoreRefusal)
		assert.False(t, obs.Last().Stored)
		assert.Equal(t, int64(1), r.Stats().PushHandles)
		assert.Zero(t, r.Stats().Stored)
	})
	t.Run("prefill", func(t *testing.T) {
		f := newFake(t)
		f.prefill = func(w http.ResponseWriter, _ map[string]json.RawMessage) { writeJSON(w, prefillAnswer(push, "")) }
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		_, err := doTurn(t, r, chatBody(false, "hi"), nil)
		require.ErrorIs(t, err, kvroute.ErrNoHandle)
		assert.Equal(t, http.StatusBadGateway, kvroute.HTTPStatus(err))
		st := r.Stats()
		assert.Equal(t, int64(1), st.PushHandles)
		assert.Equal(t, int64(1), st.NoPrefillHandle)
		assert.Equal(t, kvroute.PhasePrefill, obs.Last().NoHandle)
		for _, req := range f.requests() {
			assert.Equal(t, "prefill", req.role, "no decode leg with a push handle")
		}
	})
}

// Issue 12.3: no malformed engine output carries a handle to a client.
func TestHandlesFailClosed(t *testing.T) {
	t.Run("non-JSON decode body", func(t *testing.T) {
		for _, body := range []string{
			`oops {"kv_transfer_params":` + testDHandle,
			"plain text",
			`{"id":"d"}}`,
		} {
			f := newFake(t)
			f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) { writeJSON(w, body) }
			obs := &kvroutetest.Records{}
			r := fakeRouter(t, f, obs)
			res := send(t, serve(t, r), kvroute.PathChatCompletions, chatBody(false, "hi"), nil)
			assert.Equal(t, http.StatusBadGateway, res.status, "%s", body)
			assert.NotContains(t, string(res.raw), "kv_transfer_params")
			assert.Equal(t, kvroute.PhaseDecode, obs.Last().ErrPhase)
			var ue *kvroute.UpstreamError
			require.ErrorAs(t, obs.Last().Err, &ue)
			assert.Equal(t, kvroute.PhaseDecode, ue.Phase)
			decodes := 0
			for _, req := range f.requests() {
				if req.role == "decode" {
					decodes++
				}
			}
			assert.Equal(t, 1, decodes, "a deterministic failure is not redone")
		}
	})
	t.Run("JSON that is not an object is scrubbed", func(t *testing.T) {
		for body, want := range map[string]string{
			`["kv\u005ftransfer_params"]`: `["kv\u005ftransfer_params"]`,
			`[{"kv_transfer_params":1}]`:  `[{}]`,
		} {
			f := newFake(t)
			f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) { writeJSON(w, body) }
			r := fakeRouter(t, f, &kvroutetest.Records{})
			res := send(t, serve(t, r), kvroute.PathChatCompletions, chatBody(false, "hi"), nil)
			assert.Equal(t, http.StatusOK, res.status)
			assert.Equal(t, want, string(res.raw))
		}
	})
	t.Run("nested in a choice", func(t *testing.T) {
		f := newFake(t)
		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
			writeJSON(w, `{"id":"d","choices":[{"index":0,"kv_transfer_params":`+testDHandle+`,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}],"kv_transfer_params":`+testDHandle+`}`)
		}
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		res := post(t, serve(t, r), kvroute.PathChatCompletions, chatBody(false, "hi"), nil)
		require.Equal(t, http.StatusOK, res.status)
		assert.Equal(t, "hello", res.text)
		assert.True(t, obs.Last().Stored)
	})
	t.Run("stream comment, id and nested", func(t *testing.T) {
		f := newFake(t)
		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
			w.Header().Set("Content-Type", "text/event-stream")
			fmt.Fprintf(w, ": kv_transfer_params %s\n\n", testDHandle)
			fmt.Fprintf(w, "id: kv_transfer_params\ndata: {\"id\":\"d\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hello\"},\"finish_reason\":null,\"kv_transfer_params\":%s}]}\n\n", testDHandle)
			fmt.Fprintf(w, "data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}],\"kv_transfer_params\":%s}\n\ndata: [DONE]\n\n", testDHandle)
		}
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		res := post(t, serve(t, r), kvroute.PathChatCompletions, chatBody(true, "hi"), nil)
		require.Equal(t, http.StatusOK, res.status)
		assert.Equal(t, "hello", res.text)
		assert.True(t, obs.Last().Stored)
	})
	t.Run("error bodies", func(t *testing.T) {
		echo := `{"error":{"message":"[{'loc': ('body', 'kv_transfer_params'), 'input': {'remote_host': '10.0.0.2'}}]","type":"BadRequestError","code":400}}`
		for _, phase := range []string{"prefill", "decode"} {
			f := newFake(t)
			bad := func(w http.ResponseWriter, _ map[string]json.RawMessage) {
				w.Header().Set("Content-Type", "application/json")
				w.WriteHeader(http.StatusBadRequest)
				_, _ = io.WriteString(w, echo)
			}
			if phase == "prefill" {
				f.prefill = bad
			} else {
				f.decode = bad
			}
			r := fakeRouter(t, f, &kvroutetest.Records{})
			res := send(t, serve(t, r), kvroute.PathChatCompletions, chatBody(false, "hi"), nil)
			assert.Equal(t, http.StatusBadRequest, res.status, phase)
			assert.NotContains(t, string(res.raw), "kv_transfer_params", phase)
			assert.NotContains(t, string(res.raw), "10.0.0.2", phase)
		}
	})
}

// bigHandle is a handle of a 1M-token context with two KV groups at block
// size 16: 62,500 block ids per group.
func bigHandle() string {
	var b strings.Builder
	b.WriteString(`{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[`)
	for g := range 2 {
		if g > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('[')
		for i := range 62_500 {
			if i > 0 {
				b.WriteByte(',')
			}
			fmt.Fprintf(&b, "%d", 10_000_000+g*100_000+i)
		}
		b.WriteByte(']')
	}
	b.WriteString(`],"remote_engine_id":"d0","remote_request_id":"rd","remote_host":"10.0.0.2","remote_port":5601,"tp_size":1,"remote_num_tokens":1000000}`)
	return b.String()
}

// countHandler counts log records.
// countHandler counts the log records, but for the warning that the fake
// engine's KV capacity is unknown (its /metrics are not vLLM's), logged
// once at start (TestUnknownCapacityNamed), which is not what its users
// count.
type countHandler struct {
	n atomic.Int32
	slog.Handler
}

func (h *countHandler) Handle(_ context.Context, r slog.Record) error {
	if !strings.HasPrefix(r.Message, "kvroute: a decode engine's KV capacity is unknown") {
		h.n.Add(1)
	}
	return nil
}
func (h *countHandler) Enabled(context.Context, slog.Level) bool { return true }
func (h *countHandler) WithAttrs([]slog.Attr) slog.Handler       { return h }
func (h *countHandler) WithGroup(string) slog.Handler            { return h }

// Issue 12.4: a 1M-token handle (two KV groups) is retained and reused, in
// a stream's final event and in a body.
func TestLargeHandleEndToEnd(t *testing.T) {
	big := bigHandle()
	require.Greater(t, len(big), 1<<20)
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			f := newFake(t)
			f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
				if stream {
					streamAnswer(w, "hello", big)
				} else {
					writeJSON(w, decodeAnswer("hello", big))
				}
			}
			obs := &kvroutetest.Records{}
			r := fakeRouter(t, f, obs)
			out, err := doTurn(t, r, chatBody(stream, "hi"), nil)
			require.NoError(t, err)
			assert.Contains(t, string(out), "hello")
			assert.NotContains(t, string(out), "kv_transfer_params")
			require.True(t, obs.Last().Stored, "refusal %q", obs.Last().StoreRefusal)
			_, err = doTurn(t, r, chatBody(stream, "hi", "hello", "more"), nil)
			require.NoError(t, err)
			require.Equal(t, kvroute.ReuseHit, obs.Last().Reuse)
			reqs := f.requests()
			p := reqs[len(reqs)-2]
			require.Equal(t, "prefill", p.role)
			var got, want struct {
				Blocks [][]int `json:"remote_block_ids"`
				N      int     `json:"remote_num_tokens"`
			}
			require.NoError(t, json.Unmarshal(p.body["kv_transfer_params"], &got))
			require.NoError(t, json.Unmarshal([]byte(big), &want))
			assert.Equal(t, want, got)
		})
	}
	t.Run("bounds are options", func(t *testing.T) {
		f := newFake(t)
		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) { writeJSON(w, decodeAnswer("hello", big)) }
		obs := &kvroutetest.Records{}
		logs := &countHandler{}
		r := fakeRouter(t, f, obs, kvroute.WithLimits(kvroute.Limits{Entry: 64 << 10}), kvroute.WithLogger(slog.New(logs)))
		for i := range 3 {
			_, err := doTurn(t, r, chatBody(false, fmt.Sprintf("hi %d", i)), nil)
			require.NoError(t, err)
			assert.Equal(t, kvroute.RefuseHandleTooLarge, obs.Last().StoreRefusal)
		}
		assert.Equal(t, int64(3), r.Stats().TooLarge)
		assert.Equal(t, int32(1), logs.n.Load(), "warned once, not every turn")

		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) { streamAnswer(w, "hello", big) }
		r = fakeRouter(t, f, obs, kvroute.WithLimits(kvroute.Limits{Event: 1 << 20}))
		_, err := doTurn(t, r, chatBody(true, "hi"), nil)
		require.Error(t, err)
		assert.Equal(t, kvroute.PhaseStream, obs.Last().ErrPhase)

		for _, o := range []kvroute.Option{kvroute.WithLimits(kvroute.Limits{Event: -1}), kvroute.WithLimits(kvroute.Limits{Entry: -1})} {
			_, err := kvroute.New(kvroute.WithPrefill(f.url), kvroute.WithDecode(f.url), o)
			assert.ErrorIs(t, err, kvroute.ErrInvalidConfig)
		}
	})
}

// Issue 12.5: a client's X-Request-Id is used only when short and visible
// ASCII.
func TestRequestIDBounded(t *testing.T) {
	for _, tc := range []struct {
		name, id string
		kept     bool
	}{
		{"ordinary", "req-123_abc.DEF", true},
		{"128 bytes", strings.Repeat("a", 128), true},
		{"129 bytes", strings.Repeat("a", 128+1), false},
		{"200 KB", strings.Repeat("x", 200<<10), false},
		{"space", "a b", false},
		{"non-ASCII", "id-\u00e9", false},
		{"control", "a\x01b", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFake(t)
			obs := &kvroutetest.Records{}
			r := fakeRouter(t, f, obs)
			resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions,
				Header: http.Header{"X-Request-Id": {tc.id}}, Body: chatBody(false, "hi")})
			require.NoError(t, err)
			require.NoError(t, resp.Close())
			got := resp.Header.Get("X-Request-Id")
			if tc.kept {
				assert.Equal(t, tc.id, got)
			} else {
				assert.NotEqual(t, tc.id, got)
				assert.True(t, strings.HasPrefix(got, "bidikv-"), got)
			}
			assert.Equal(t, got, resp.Header.Get("X-Request-Id"))
			assert.Equal(t, got, obs.Last().RequestID)
			engineID := obs.Last().EngineRequestID
			if tc.kept {
				assert.Regexp(t, `^`+regexp.QuoteMeta(tc.id)+`-[0-9a-f]{16}$`, engineID, "the client's id, made unique for the engines")
			} else {
				assert.Equal(t, got, engineID)
			}
			reqs := f.requests()
			require.Len(t, reqs, 2)
			for _, q := range reqs {
				assert.Equal(t, engineID, q.requestID, q.role)
			}
		})
	}
}

// Issue 12.7: a request that fails validation is no reuse miss, and every
// first turn misses for the same reason whatever the Identifier.
func TestTurnRecordReuseSemantics(t *testing.T) {
	t.Run("validation failure", func(t *testing.T) {
		f := newFake(t)
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		_, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: []byte("{nope")})
		require.ErrorIs(t, err, kvroute.ErrBadRequest)
		rec := obs.Last()
		assert.Empty(t, rec.Reuse)
		assert.Empty(t, rec.MissReason)
		assert.Equal(t, kvroute.PhaseLookup, rec.ErrPhase)
		assert.Empty(t, f.requests())
	})
	t.Run("closed router", func(t *testing.T) {
		f := newFake(t)
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		require.NoError(t, r.Close())
		_, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: chatBody(false, "hi")})
		require.ErrorIs(t, err, kvroute.ErrClosed)
		assert.Empty(t, obs.Last().Reuse)
		assert.Equal(t, kvroute.PhaseLookup, obs.Last().ErrPhase)
	})
	t.Run("reuse off", func(t *testing.T) {
		f := newFake(t)
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs, kvroute.WithReuse(false))
		_, err := doTurn(t, r, chatBody(false, "hi"), nil)
		require.NoError(t, err)
		assert.Equal(t, kvroute.ReuseOff, obs.Last().Reuse)
	})
	first := []struct {
		name  string
		ident kvroute.Identifier
		path  string
		body  string
	}{
		{"continuation chat", kvroute.ContinuationKeys{}, kvroute.PathChatCompletions, string(chatBody(false, "hi"))},
		{"continuation completions, short prompt", kvroute.ContinuationKeys{}, kvroute.PathCompletions, `{"model":"m","prompt":"hi","max_tokens":4}`},
		{"continuation completions", kvroute.ContinuationKeys{}, kvroute.PathCompletions, `{"model":"m","prompt":"` + systemPrompt + `","max_tokens":4}`},
		{"explicit id", kvroute.ContinuationKeys{ByConversationID: true}, kvroute.PathChatCompletions, `{"model":"m","messages":[{"role":"user","content":"hi"}],"conversation_id":"c1"}`},
		{"explicit id absent", kvroute.ContinuationKeys{ByConversationID: true}, kvroute.PathChatCompletions, string(chatBody(false, "hi"))},
	}
	for _, tc := range first {
		t.Run("first turn "+tc.name, func(t *testing.T) {
			f := newFake(t)
			obs := &kvroutetest.Records{}
			r := fakeRouter(t, f, obs, kvroute.WithIdentifier(tc.ident))
			resp, err := r.Do(context.Background(), &kvroute.Request{Path: tc.path, Header: http.Header{}, Body: []byte(tc.body)})
			require.NoError(t, err)
			require.NoError(t, resp.Close())
			assert.Equal(t, kvroute.ReuseMiss, obs.Last().Reuse)
			assert.Equal(t, kvroute.MissNotFound, obs.Last().MissReason)
		})
	}
	t.Run("identifier error", func(t *testing.T) {
		f := newFake(t)
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs, kvroute.WithIdentifier(failingIdentifier{}))
		_, err := doTurn(t, r, chatBody(false, "hi"), nil)
		require.NoError(t, err)
		assert.Equal(t, kvroute.MissNoKey, obs.Last().MissReason)
	})
}

type failingIdentifier struct{ kvroute.ContinuationKeys }

func (failingIdentifier) Lookup(*kvroute.Request) (kvroute.Candidates, error) {
	return kvroute.Candidates{}, errors.New("boom")
}

// Issue 12.3: a stream event that may hold a handle but is not JSON ends
// the stream, and the error event names no handle either.
func TestMalformedStreamEventFailsClosed(t *testing.T) {
	f := newFake(t)
	f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, "data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hello\"},\"finish_reason\":null}]}\n\n")
		_, _ = io.WriteString(w, "data: {\"kv_transfer_params\":{\"remote_host\":\"10.0.0.2\"\n\n")
	}
	obs := &kvroutetest.Records{}
	r := fakeRouter(t, f, obs)
	res := send(t, serve(t, r), kvroute.PathChatCompletions, chatBody(true, "hi"), nil)
	require.Equal(t, http.StatusOK, res.status)
	s := scanStream(t, res.raw)
	assert.NotEmpty(t, s.errData)
	assert.False(t, s.done)
	assert.NotContains(t, string(res.raw), "10.0.0.2")
	assert.Equal(t, kvroute.PhaseStream, obs.Last().ErrPhase)
}

// Issue 12.4, token mode: the first event of a 1M-token stream carries the
// prompt's token ids (about 8 MB), the final one the two-group handle; the
// entry keeps a fingerprint of 62,500 blocks. All of it fits the defaults.
func TestLargeContextTokenMode(t *testing.T) {
	const n = 1_000_000
	var ids strings.Builder
	ids.WriteByte('[')
	for i := range n {
		if i > 0 {
			ids.WriteByte(',')
		}
		fmt.Fprintf(&ids, "%d", 100_000+i%50_000)
	}
	ids.WriteByte(']')
	require.Greater(t, ids.Len(), 1<<20)
	big := bigHandle()
	f := newFake(t)
	f.decode = func(w http.ResponseWriter, body map[string]json.RawMessage) {
		assert.Equal(t, "true", string(body["return_token_ids"]))
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprintf(w, "data: {\"id\":\"d\",\"prompt_token_ids\":%s,\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n", ids.String())
		fmt.Fprintf(w, "data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hello\"},\"token_ids\":[42],\"finish_reason\":null}]}\n\n")
		fmt.Fprintf(w, "data: {\"id\":\"d\",\"choices\":[{\"index\":0,\"delta\":{},\"token_ids\":[2],\"finish_reason\":\"stop\"}],\"kv_transfer_params\":%s}\n\ndata: [DONE]\n\n", big)
	}
	obs := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(f.url), kvroute.WithDecode(f.url), kvroute.WithObserver(obs))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	out, err := doTurn(t, r, chatBody(true, "hi"), nil)
	require.NoError(t, err)
	assert.Contains(t, string(out), "hello")
	assert.NotContains(t, string(out), "prompt_token_ids", "ids the client did not ask for are stripped")
	assert.NotContains(t, string(out), "kv_transfer_params")
	rec := obs.Last()
	require.True(t, rec.Stored, "refusal %q", rec.StoreRefusal)
	assert.Zero(t, r.Stats().TokenFallbacks, "retained with its token fingerprint")
}

// Issue 12.2 against the simulator: a decode engine without
// bidirectional_kv_xfer answers without a handle; the turns succeed and
// are counted as NoDecodeHandle, not as a stock stream.
func TestNoDecodeHandleSimulated(t *testing.T) {
	reg := kvroutetest.NewRegistry()
	p := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg))
	d := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithBidirectional(false))
	obs := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(p.URL()), kvroute.WithDecode(d.URL()), kvroute.WithObserver(obs))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 12}
	conv.say(systemPrompt)
	res := post(t, url, conv.path, conv.body(), nil)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	assert.Equal(t, reference(t, conv.path, conv.body()), res.text)
	assert.Equal(t, int64(1), r.Stats().NoDecodeHandle)
	assert.Equal(t, kvroute.PhaseDecode, obs.Last().NoHandle)
	assert.False(t, obs.Last().Stored)
}

// Issue 12.1 against the simulator's older engine (P emits its handle only
// on the length cap): a client stop string inside P's first token.
func TestPrefillLegFinishesOnLengthSimulated(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithPrefillHandleOnLengthOnly(true))
			g := newRig(t, c, stream)
			conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 24}
			conv.say(systemPrompt)
			for i := range 3 {
				if i > 0 {
					conv.say(userText(i))
				}
				conv.extra = nil
				plain := reference(t, conv.path, conv.body())
				require.NotEmpty(t, plain)
				conv.extra = map[string]any{"stop": []string{plain[:1]}}
				body := conv.body()
				res := post(t, g.url, conv.path, body, nil)
				require.Equal(t, http.StatusOK, res.status, "turn %d: %s", i, res.raw)
				assert.Equal(t, reference(t, conv.path, body), res.text, "turn %d", i)
				conv.hear(res.text)
			}
			assert.Zero(t, g.r.Stats().NoPrefillHandle)
		})
	}
}

// Content mode on /v1/completions: the prompt-shaping fields are part of
// the content check, so a turn that resends the stored text with
// add_special_tokens switched (a BOS token in front of the same text: the
// held blocks are other tokens) is not given the handle; a turn with the
// same fields is.
func TestContentModeCompletionShaping(t *testing.T) {
	const reply = " answer"
	f := newFake(t)
	f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) {
		writeJSON(w, `{"id":"d","object":"text_completion","choices":[{"index":0,"text":`+mustJSON(reply)+`,"finish_reason":"stop"}],"kv_transfer_params":`+testDHandle+`}`)
	}
	obs := &kvroutetest.Records{}
	r := fakeRouter(t, f, obs)
	p1 := strings.Repeat("history ", 40) + "Q:"
	turn := func(prompt string, extra map[string]any) kvroute.TurnRecord {
		t.Helper()
		m := map[string]any{"model": kvroutetest.DefaultModel, "prompt": prompt, "max_tokens": 8}
		for k, v := range extra {
			m[k] = v
		}
		resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathCompletions, Header: http.Header{}, Body: []byte(mustJSON(m))})
		require.NoError(t, err)
		require.NoError(t, resp.Close())
		return obs.Last()
	}
	for _, tc := range []struct {
		name         string
		turn1, turn2 map[string]any
		hit          bool
	}{
		{"add_special_tokens switched on", nil, map[string]any{"add_special_tokens": true}, false},
		{"add_special_tokens switched off", map[string]any{"add_special_tokens": true}, map[string]any{"add_special_tokens": false}, false},
		{"mm_processor_kwargs added", nil, map[string]any{"mm_processor_kwargs": map[string]any{"num_crops": 4}}, false},
		{"the same fields", map[string]any{"add_special_tokens": true}, map[string]any{"add_special_tokens": true, "temperature": 0.5}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			start := p1 + " " + tc.name + "."
			rec := turn(start, tc.turn1)
			require.Equal(t, kvroute.ReuseMiss, rec.Reuse)
			require.True(t, rec.Stored, "retained: %s", rec.StoreRefusal)
			rec = turn(start+reply+"\nUser: more", tc.turn2)
			legs := f.requests()
			sent := string(legs[len(legs)-2].body["kv_transfer_params"])
			if tc.hit {
				assert.Equal(t, kvroute.ReuseHit, rec.Reuse, "%s", rec.MissReason)
				assert.Contains(t, sent, `"remote_engine_id":"d0"`)
			} else {
				assert.Equal(t, kvroute.ReuseMiss, rec.Reuse)
				assert.NotContains(t, sent, `"d0"`, "the handle of other tokens never reaches P")
			}
		})
	}
}
