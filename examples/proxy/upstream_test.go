package main

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// An overloaded prefill engine's answer reaches the client as what it is,
// through the proxy: P's 503 as 503 and P's 429 as 503, each with
// Retry-After (the engine's own, else 1), in the API's error shape, naming
// the phase; and no error a client reads names an engine's address.
func TestPrefillOverloadReachesClient(t *testing.T) {
	var mode atomic.Value
	p := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		status, ra := 503, ""
		m, _ := mode.Load().(string) // unset for the capability probe at start-up
		switch m {
		case "503 retry-after 7":
			ra = "7"
		case "429 retry-after 3":
			status, ra = 429, "3"
		case "429":
			status = 429
		}
		if ra != "" {
			w.Header().Set("Retry-After", ra)
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(`{"error":{"message":"engine at ` + r.Host + ` is overloaded","type":"server_error","code":503}}`))
	}))
	t.Cleanup(p.Close)
	d := kvroutetest.NewEngine(t)
	// An address that refuses connections, for the unreachable engine.
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	refused := "http://" + ln.Addr().String()
	require.NoError(t, ln.Close())

	px := startInProcess(t, nil, "--prefill", p.URL, "--decode", d.URL())
	down := startInProcess(t, nil, "--prefill", refused, "--decode", d.URL())
	chat := `{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`
	messages := `{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`
	for _, tc := range []struct {
		mode, retryAfter string
	}{
		{"503 retry-after 7", "7"},
		{"503", "1"}, // retried, then the default
		{"429 retry-after 3", "3"},
		{"429", "1"},
	} {
		mode.Store(tc.mode)
		status, h, body := px.do(t, http.MethodPost, "/v1/chat/completions", chat)
		assert.Equal(t, http.StatusServiceUnavailable, status, "%s: %s", tc.mode, body)
		assert.Equal(t, tc.retryAfter, h.Get("Retry-After"), tc.mode)
		assert.Contains(t, body, `"code":"prefill_failed"`, tc.mode)
		assert.Contains(t, body, `"message":"kvroute: prefill failed: engine status `, tc.mode)
		assert.NotContains(t, body, "127.0.0.1", "%s: no engine address reaches a client", tc.mode)

		status, h, body = px.do(t, http.MethodPost, "/v1/messages", messages)
		assert.Equal(t, http.StatusServiceUnavailable, status, "%s: %s", tc.mode, body)
		assert.Equal(t, tc.retryAfter, h.Get("Retry-After"), tc.mode)
		assert.Contains(t, body, `{"type":"error","error":{"type":"overloaded_error","message":"kvroute: prefill failed`, tc.mode)
		assert.NotContains(t, body, "127.0.0.1", tc.mode)
	}

	for _, path := range []string{"/v1/chat/completions", "/v1/messages"} {
		body := chat
		if path == "/v1/messages" {
			body = messages
		}
		status, h, got := down.do(t, http.MethodPost, path, body)
		assert.Equal(t, http.StatusBadGateway, status, got)
		assert.Empty(t, h.Get("Retry-After"))
		assert.Contains(t, got, "kvroute: prefill failed: the engine could not be reached", path)
		assert.NotContains(t, got, "127.0.0.1", "%s: no engine address reaches a client", path)
		assert.NotContains(t, got, strings.TrimPrefix(refused, "http://"), path)
	}
}

// Two clients that choose the same X-Request-Id never share a request id
// on an engine: each turn's legs carry the client's id with a random
// suffix (one id for both legs of a turn, as the protocol requires), each
// client gets its own id back, and the turn's log line names the id the
// engines saw.
func TestRequestIDsUniqueOnEngines(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	px := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(), "--log-level", "debug")
	const id = "client-chosen-id"
	for i, q := range []string{"tell me about foxes", "tell me about owls"} {
		body := `{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"` + q + `"}]}`
		status, h, got := px.do(t, http.MethodPost, "/v1/chat/completions", body, "X-Request-Id", id)
		require.Equal(t, http.StatusOK, status, "client %d: %s", i, got)
		assert.Equal(t, id, h.Get("X-Request-Id"), "the client gets its own id back")
	}
	var pre, dec []string
	for _, r := range cl.Prefill[0].Requests() {
		if r.Role == "prefill" {
			pre = append(pre, r.RequestID)
		}
	}
	for _, r := range cl.Decode[0].Requests() {
		if r.Role == "decode" {
			dec = append(dec, r.RequestID)
		}
	}
	require.Len(t, pre, 2)
	require.Len(t, dec, 2)
	assert.NotEqual(t, pre[0], pre[1], "two clients' turns never share a request id on an engine")
	for i := range pre {
		assert.Regexp(t, `^`+id+`-[0-9a-f]{16}$`, pre[i], "the client's id, for correlation")
		assert.Equal(t, pre[i], dec[i], "both legs of one turn carry one X-Request-Id")
		assert.Contains(t, px.stderr.String(), "request_id="+id+" engine_request_id="+pre[i], "the turn's log names the id the engines saw")
	}
}
