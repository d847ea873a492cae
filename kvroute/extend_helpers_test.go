package kvroute

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"
)

// A minimal engine for the extension examples (extend_*_test.go), which
// test the seams from inside the package: a prefill leg (its handle with
// do_remote_decode true) gets one token and P's handle, a decode leg gets
// answer's body and, when it carried P's handle, a handle of D's (a
// request without one gets none, as from vLLM). An answer of nil is an
// engine error (500). It records every request it got.
type toyEngine struct {
	url    string
	answer func(path string, body map[string]json.RawMessage) []byte // the decode leg's body, without a handle

	mu   sync.Mutex
	legs []toyLeg
}

type toyLeg struct {
	path    string
	prefill bool
	release bool // a release request (a prefill leg of the router's own)
	body    map[string]json.RawMessage
}

// toyHandle is a handle vLLM could read: 64 tokens in 4 blocks of 16.
const toyHandle = `{"do_remote_decode":false,"do_remote_prefill":true,"remote_engine_id":"toy","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":5600,"remote_block_ids":[[1,2,3,4]],"remote_num_tokens":64}`

func newToyEngine(t *testing.T, answer func(path string, body map[string]json.RawMessage) []byte) *toyEngine {
	e := &toyEngine{answer: answer}
	srv := httptest.NewServer(http.HandlerFunc(e.serve))
	t.Cleanup(srv.Close)
	e.url = srv.URL
	return e
}

func (e *toyEngine) serve(w http.ResponseWriter, r *http.Request) {
	raw, _ := io.ReadAll(r.Body)
	var body map[string]json.RawMessage
	if json.Unmarshal(raw, &body) != nil {
		http.Error(w, `{"error":{"message":"not JSON"}}`, http.StatusBadRequest)
		return
	}
	prefill := bytes.Contains(body[kvKey], []byte(`"do_remote_decode":true`))
	e.mu.Lock()
	e.legs = append(e.legs, toyLeg{path: r.URL.Path, prefill: prefill, release: r.Header.Get("User-Agent") == "bidikv-release", body: body})
	e.mu.Unlock()
	w.Header().Set("Content-Type", "application/json")
	if prefill {
		_, _ = w.Write([]byte(`{"choices":[{"index":0,"text":"x","finish_reason":"length"}],"kv_transfer_params":` + toyHandle + `}`))
		return
	}
	out := e.answer(r.URL.Path, body)
	if out == nil {
		w.WriteHeader(http.StatusInternalServerError)
		_, _ = w.Write([]byte(`{"error":{"message":"engine failure","type":"InternalServerError","code":500}}`))
		return
	}
	if _, sent := body[kvKey]; !sent {
		_, _ = w.Write(out)
		return
	}
	_, _ = w.Write(append(out[:len(out)-1:len(out)-1], []byte(`,"kv_transfer_params":`+strings.Replace(toyHandle, `"do_remote_prefill":true`, `"do_remote_prefill":false`, 1)+`}`)...))
}

// last returns the engine's last leg of each kind (release requests
// aside).
func (e *toyEngine) last(prefill bool) toyLeg {
	e.mu.Lock()
	defer e.mu.Unlock()
	for i := len(e.legs) - 1; i >= 0; i-- {
		if e.legs[i].prefill == prefill && !e.legs[i].release {
			return e.legs[i]
		}
	}
	return toyLeg{}
}

// count returns the number of requests the engine got.
func (e *toyEngine) count() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.legs)
}

// toyRouter serves a Router over one toy engine, as prefill and decode,
// with the restart reads off (the toy has no /metrics).
func toyRouter(t *testing.T, e *toyEngine, opts ...Option) (*Router, string) {
	t.Helper()
	r, err := New(append([]Option{WithPrefill(e.url), WithDecode(e.url), WithHealth(Health{RestartCheck: -1})}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	return r, srv.URL
}

// toyPost posts body to the router's path and returns the status, the
// headers and the body.
func toyPost(t *testing.T, url, path, body string) (int, http.Header, []byte) {
	t.Helper()
	resp, err := http.Post(url+path, "application/json", strings.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, resp.Header, b
}
