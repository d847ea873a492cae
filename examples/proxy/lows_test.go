package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// A client's own errors (malformed bodies, fields the router refuses, an
// engine's 4xx) are logged at debug level, so that a client cannot flood
// the log; failures on the proxy's or an engine's side still warn.
func TestClientErrorsLoggedAtDebug(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	p := startInProcess(t, nil, "--prefill", e.URL(), "--decode", e.URL())
	for _, body := range []string{
		`{"model":`,
		`[1,2,3]`,
		`{"model":"sim-model","messages":"not a list","max_tokens":4}`,
		`{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"stream":"maybe"}`,
		`{"model":"no-such-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`, // the engine's 404
	} {
		for range 20 {
			status, _, got := p.do(t, http.MethodPost, "/v1/chat/completions", body)
			require.GreaterOrEqual(t, status, 400, got)
			require.Less(t, status, 500, got)
		}
	}
	for _, line := range strings.Split(p.stderr.String(), "\n") {
		if strings.Contains(line, `msg="engines: `) {
			continue // the start-up warnings about the engines found
		}
		assert.NotContains(t, line, "level=WARN", "client errors never warn")
	}

	down := startInProcess(t, nil) // engines that refuse connections
	status, _, got := down.do(t, http.MethodPost, "/v1/chat/completions", `{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4}`)
	require.Equal(t, http.StatusBadGateway, status, got)
	assert.Contains(t, down.stderr.String(), "level=WARN msg=turn", "an upstream failure warns")
}

// An --api-key-file that every user of the host can read is accepted, with
// a warning at start-up; a private one is not warned about.
func TestAPIKeyFileModeWarned(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range []struct {
		mode os.FileMode
		warn bool
	}{{0o644, true}, {0o604, true}, {0o606, true}, {0o640, false}, {0o600, false}, {0o400, false}} {
		f := filepath.Join(dir, fmt.Sprintf("keys-%o", tc.mode))
		require.NoError(t, os.WriteFile(f, []byte("sk-file\n"), 0o600))
		require.NoError(t, os.Chmod(f, tc.mode))
		p := startInProcess(t, nil, "--api-key-file", f)
		warned := strings.Contains(p.stderr.String(), "level=WARN msg=\"--api-key-file "+f+" is readable or writable by every user")
		assert.Equal(t, tc.warn, warned, "mode %04o: %s", tc.mode, p.stderr.String())
	}
}

// /metrics names the engines' URLs in its labels: with
// --metrics-require-key it takes an inbound key, by either header; without
// it, it stays open for scrapers on a trusted network (the default). The
// flag needs inbound keys.
func TestMetricsRequireKey(t *testing.T) {
	p := startInProcess(t, nil, "--api-key", "sk-scrape", "--metrics-require-key")
	status, h, body := p.do(t, http.MethodGet, "/metrics", "")
	assertJSONError(t, status, h, body, http.StatusUnauthorized, "invalid_api_key")
	assert.NotContains(t, body, "127.0.0.1")
	for _, hdr := range [][]string{{"Authorization", "Bearer sk-scrape"}, {"X-Api-Key", "sk-scrape"}} {
		status, _, body = p.do(t, http.MethodGet, "/metrics", "", hdr...)
		assert.Equal(t, http.StatusOK, status, body)
		assert.Contains(t, body, "bidikv_endpoint_up")
	}
	open := startInProcess(t, nil, "--api-key", "sk-scrape")
	status, _, body = open.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, http.StatusOK, status, "open by default")
	assert.Contains(t, body, "bidikv_endpoint_up")

	_, err := parseConfig([]string{"--metrics-require-key"}, noEnv, io.Discard)
	require.ErrorIs(t, err, errUsage)
	assert.Contains(t, err.Error(), "--metrics-require-key needs inbound API keys")
}

// A client speaking HTTP/2 with prior knowledge (h2c) gets 505 HTTP
// Version Not Supported, in JSON, and the connection closed: not a 404 for
// a route named "*".
func TestHTTP2PriorKnowledge(t *testing.T) {
	p := startInProcess(t, nil)
	c := p.dial(t)
	_, err := fmt.Fprint(c, "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
	require.NoError(t, err)
	br := bufio.NewReader(c)
	resp, body := rawResponse(t, br)
	assertJSONError(t, resp.StatusCode, resp.Header, body, http.StatusHTTPVersionNotSupported, "http_version_not_supported")
	assert.True(t, resp.Close, "the connection is closed")
	_, err = br.ReadByte()
	assert.Error(t, err, "nothing follows: the rest of the preface is not read as requests")
	_, _, page := p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "1", metricValue(page, `bidikv_rejected_requests_total{reason="http_version",status="505"}`))
}

// go-redis's own lines (a failed dial per call while Redis is down) go
// through the proxy's logger: with --log-format json every line the
// process writes to stderr is a JSON record, go-redis's included.
func TestGoRedisLogsStructured(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts a process")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	redisAddr := ln.Addr().String()
	require.NoError(t, ln.Close()) // Redis is down
	e := kvroutetest.NewEngine(t)
	px := start(t, "proxy", proxyReady, "--host", "127.0.0.1", "--port", "0", "--health-interval", "1h",
		"--prefill", e.URL(), "--decode", e.URL(), "--redis-url", "redis://"+redisAddr+"/0",
		"--log-format", "json", "--log-level", "debug")
	for i := range 3 {
		body := fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":"redis is down, turn %d"}],"max_tokens":4}`, i)
		resp, err := http.Post(px.url+"/v1/chat/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Equal(t, http.StatusOK, resp.StatusCode, "a Redis outage is a miss, never an error")
	}
	var goRedis int
	deadline := time.Now().Add(10 * time.Second)
	for goRedis == 0 && time.Now().Before(deadline) {
		goRedis = strings.Count(px.stderr.String(), `"msg":"go-redis"`)
		time.Sleep(50 * time.Millisecond)
	}
	for _, l := range strings.Split(strings.TrimSpace(px.stderr.String()), "\n") {
		var rec map[string]any
		assert.NoError(t, json.Unmarshal([]byte(l), &rec), "not a JSON record: %q", l)
	}
	assert.Positive(t, goRedis, "go-redis's dial failures are logged, as records")
}
