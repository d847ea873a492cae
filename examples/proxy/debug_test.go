package main

import (
	"io"
	"net/http"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var debugReady = regexp.MustCompile(`profiler on (http://\S+)/debug/pprof/`)

func TestDebugAddr(t *testing.T) {
	p := startInProcess(t, nil, "--debug-addr", "127.0.0.1:0")
	m := debugReady.FindStringSubmatch(p.stdout.String())
	require.NotNil(t, m, "no profiler line in %q", p.stdout.String())
	get := func(url string) (int, string) {
		resp, err := p.client.Get(url)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	status, body := get(m[1] + "/debug/pprof/")
	assert.Equal(t, http.StatusOK, status)
	assert.Contains(t, body, "goroutine")
	status, _ = get(m[1] + "/debug/pprof/heap?debug=1")
	assert.Equal(t, http.StatusOK, status)
	status, body = get(p.url + "/debug/pprof/")
	assert.Equal(t, http.StatusNotFound, status, "the profiler must not be on the proxy's port: %s", body)
}

func TestDebugAddrOffByDefault(t *testing.T) {
	p := startInProcess(t, nil)
	assert.NotRegexp(t, debugReady, p.stdout.String())
}

func TestDebugAddrBad(t *testing.T) {
	err := run(t.Context(), []string{"--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1", "--port", "0",
		"--debug-addr", "127.0.0.1:notaport"}, noEnv, io.Discard, io.Discard)
	require.ErrorIs(t, err, errUsage)
	assert.Contains(t, err.Error(), "--debug-addr")
}
