package main

import (
	"bufio"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Wrong methods get 405 with Allow, unknown paths 404, both in OpenAI's
// error shape.
func TestMethodsAndRoutes(t *testing.T) {
	p := startInProcess(t, nil)
	tests := []struct {
		method, path string
		status       int
		allow, code  string
	}{
		{http.MethodGet, "/v1/chat/completions", 405, "POST", "method_not_allowed"},
		{http.MethodPut, "/v1/completions", 405, "POST", "method_not_allowed"},
		{http.MethodPost, "/health", 405, "GET, HEAD", "method_not_allowed"},
		{http.MethodDelete, "/ready", 405, "GET, HEAD", "method_not_allowed"},
		{http.MethodPost, "/metrics", 405, "GET, HEAD", "method_not_allowed"},
		{http.MethodPost, "/v1/models", 405, "GET, HEAD", "method_not_allowed"},
		{http.MethodGet, "/v1/nope", 404, "", "not_found"},
		{http.MethodGet, "/v1/models/", 404, "", "not_found"},
	}
	for _, tt := range tests {
		t.Run(tt.method+" "+tt.path, func(t *testing.T) {
			status, h, body := p.do(t, tt.method, tt.path, "")
			assertJSONError(t, status, h, body, tt.status, tt.code)
			assert.Equal(t, tt.allow, h.Get("Allow"))
		})
	}
	status, _, _ := p.do(t, http.MethodHead, "/health", "")
	assert.Equal(t, http.StatusOK, status)
	_, _, page := p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "6", metricValue(page, `bidikv_rejected_requests_total{reason="method_not_allowed",status="405"}`))
}

// Requests net/http cannot parse, and header blocks above the limit, get
// OpenAI's JSON error shape, not net/http's text/plain.
func TestMalformedRequestsGetJSON(t *testing.T) {
	p := startInProcess(t, nil, "--max-header-bytes", "8192")
	tests := []struct {
		name, raw string
		status    int
		code      string
	}{
		{"bad Content-Length", "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Length: abc\r\n\r\n", 400, "invalid_request"},
		{"two Content-Lengths", "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "invalid_request"},
		{"no Host", "GET /health HTTP/1.1\r\n\r\n", 400, "invalid_request"},
		{"bad transfer encoding", "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501, "not_implemented"},
		{"headers above the flag", "GET /health HTTP/1.1\r\nHost: proxy\r\nX-Big: " + strings.Repeat("a", 10000) + "\r\n\r\n", 431, "headers_too_large"},
		{"headers above net/http's limit", "GET /health HTTP/1.1\r\nHost: proxy\r\nX-Big: " + strings.Repeat("a", 40000) + "\r\n\r\n", 431, "headers_too_large"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := p.dial(t)
			_, err := io.WriteString(c, tt.raw)
			require.NoError(t, err)
			resp, body := rawResponse(t, bufio.NewReader(c))
			assertJSONError(t, resp.StatusCode, resp.Header, body, tt.status, tt.code)
			assert.True(t, resp.Close, "the connection is closed after the error")
		})
	}
	t.Run("headers under the limit", func(t *testing.T) {
		status, _, _ := p.do(t, http.MethodGet, "/health", "", "X-Big", strings.Repeat("a", 6000))
		assert.Equal(t, http.StatusOK, status)
	})
}

func TestRewriteNetHTTPError(t *testing.T) {
	b, ok := rewriteNetHTTPError([]byte("HTTP/1.1 400 Bad Request: missing required Host header"+netHTTPErrorHeaders+"400 Bad Request: missing required Host header"), false)
	require.True(t, ok)
	resp, err := http.ReadResponse(bufio.NewReader(strings.NewReader(string(b))), nil)
	require.NoError(t, err)
	body, _ := io.ReadAll(resp.Body)
	assert.Equal(t, 400, resp.StatusCode)
	assert.JSONEq(t, `{"error":{"message":"proxy: 400 Bad Request: missing required Host header","type":"invalid_request_error","param":null,"code":"invalid_request"}}`, string(body))

	for _, s := range []string{
		"HTTP/1.1 200 OK\r\nContent-Type: text/plain; charset=utf-8\r\nDate: x\r\n\r\nhi",
		"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain; charset=utf-8\r\nDate: x\r\nConnection: close\r\n\r\nx",
		"data: {}\n\n",
		"HTTP/1.1 ",
	} {
		_, ok := rewriteNetHTTPError([]byte(s), false)
		assert.False(t, ok, "handler output passes unchanged: %q", s)
	}
}

// Inbound keys from BIDIKV_API_KEYS and --api-key-file are enforced, and
// never appear on the command line.
func TestKeysFromEnvAndFile(t *testing.T) {
	f := filepath.Join(t.TempDir(), "keys")
	require.NoError(t, os.WriteFile(f, []byte("sk-file\n"), 0o600))
	p := startInProcess(t, func(k string) string { return map[string]string{envAPIKeys: "sk-env"}[k] }, "--api-key-file", f)
	for _, tt := range []struct {
		auth   string
		status int
	}{
		{"", http.StatusUnauthorized},
		{"Bearer sk-nope", http.StatusUnauthorized},
		{"Bearer sk-env", http.StatusServiceUnavailable}, // past auth; no engine answers
		{"Bearer sk-file", http.StatusServiceUnavailable},
	} {
		status, h, body := p.do(t, http.MethodGet, "/v1/models", "", "Authorization", tt.auth)
		assert.Equal(t, tt.status, status, "%q: %s", tt.auth, body)
		assert.Equal(t, "application/json", h.Get("Content-Type"))
	}
	assert.Contains(t, p.stderr.String(), "inbound_keys=2")
}
