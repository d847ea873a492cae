package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Issue 21, items 3 to 6 and 20, end to end: through the proxy, a decode
// engine that hides its handle in every malformed way, on every API,
// streaming or not, gets nothing of it to the client.
func TestHostileDecodeEngineThroughProxy(t *testing.T) {
	e := kvroutetest.NewHostileEngine(t, kvroutetest.HostileAnswer{})
	p := startInProcess(t, nil, "--prefill", e.URL(), "--decode", e.URL())
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	t.Cleanup(client.CloseIdleConnections)
	kvroutetest.TestHostile(t, e, p.url, client)
}

// The routes the proxy passes to any engine (/v1/models,
// /v1/messages/count_tokens) take the same mechanism: JSON that sse.Scrub
// lets through, every kv_transfer_params removed, or a 502.
func TestPassThroughScrubbed(t *testing.T) {
	var answer atomic.Value
	answer.Store("")
	e := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, answer.Load().(string))
	}))
	t.Cleanup(e.Close)
	p := startInProcess(t, nil, "--prefill", e.URL, "--decode", e.URL)
	for _, tc := range []struct {
		answer, want string
		status       int
	}{
		{`{"input_tokens":3,"\u006bv_transfer_params":` + kvroutetest.HostileHandle + `}`, `{"input_tokens":3}`, http.StatusOK},
		{`{"input_tokens":3,"usage":{"remote_engine_id":"` + kvroutetest.HostileEngineID + `"}}`, "", http.StatusBadGateway},
		{"input_tokens=3 " + kvroutetest.HostileEngineID, "", http.StatusBadGateway},
	} {
		answer.Store(tc.answer)
		status, h, body := p.do(t, http.MethodPost, "/v1/messages/count_tokens", `{"model":"m","messages":[{"role":"user","content":"hi"}]}`)
		assert.Equal(t, tc.status, status, body)
		require.NoError(t, kvroutetest.CheckLeak(h, []byte(body), kvroutetest.HostileSecrets()...))
		if tc.want != "" {
			assert.Equal(t, tc.want, body)
		}
	}
}
