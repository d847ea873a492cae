package main

import (
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// An engine's Server and Date headers never reach a client (vLLM's uvicorn
// sends both): the client gets the proxy's own Date and no Server; the
// engine's hop-by-hop headers are dropped too, its other end-to-end
// headers kept. Streams and bodies alike.
func TestEngineServerAndDateDropped(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	const engineDate = "Mon, 02 Jan 2006 15:04:05 GMT"
	u, err := url.Parse(cl.Decode[0].URL())
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.ModifyResponse = func(resp *http.Response) error {
		resp.Header.Set("Server", "uvicorn")
		resp.Header.Set("Date", engineDate)
		resp.Header.Set("Connection", "X-Hop")
		resp.Header.Set("X-Hop", "1")
		resp.Header.Set("X-Engine-Note", "kept")
		return nil
	}
	d := httptest.NewServer(rp)
	t.Cleanup(d.Close)
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", d.URL)
	for _, body := range []string{goodChat, `{"model":"sim-model","messages":[{"role":"user","content":"are you there?"}],"max_tokens":8,"stream":true}`} {
		status, h, got := p.do(t, http.MethodPost, "/v1/chat/completions", body)
		require.Equal(t, http.StatusOK, status, got)
		assert.Empty(t, h.Values("Server"))
		require.Len(t, h.Values("Date"), 1)
		date, err := http.ParseTime(h.Get("Date"))
		require.NoError(t, err)
		assert.WithinDuration(t, time.Now(), date, time.Minute, "the proxy's own Date")
		assert.Empty(t, h.Get("X-Hop"))
		assert.Equal(t, "kept", h.Get("X-Engine-Note"))
	}
}
