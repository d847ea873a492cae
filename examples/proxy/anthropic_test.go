package main

import (
	"bufio"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// anthropicError matches Anthropic's error shape with the proxy's prefix:
// what Anthropic's SDKs parse into error.type and error.message.
var anthropicError = regexp.MustCompile(`^\{"type":"error","error":\{"type":"[a-z_]+","message":"proxy: [^"]*"\}\}$`)

func assertAnthropicError(t *testing.T, status int, h http.Header, body string, wantStatus int, wantType string) {
	t.Helper()
	assert.Equal(t, wantStatus, status, body)
	assert.Equal(t, "application/json", h.Get("Content-Type"))
	assert.Regexp(t, anthropicError, body)
	var e struct {
		Type  string `json:"type"`
		Error struct{ Type, Message string }
	}
	require.NoError(t, json.Unmarshal([]byte(body), &e), body)
	assert.Equal(t, "error", e.Type)
	assert.Equal(t, wantType, e.Error.Type, body)
}

// What the proxy answers itself on /v1/messages (a wrong key, a body over
// the limit, a shed turn, a wrong method, an unknown sub-path) is in
// Anthropic's error shape, as the router's own errors there are; the
// OpenAI routes keep OpenAI's. Anthropic's SDKs read both the body's
// error.type and the Request-Id header.
func TestAnthropicErrorShape(t *testing.T) {
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	msgs := `{"model":"m","max_tokens":4,"messages":[{"role":"user","content":"hi"}]}`
	t.Run("keys and limits", func(t *testing.T) {
		p := startInProcess(t, nil, "--api-key", "sk-one", "--max-body-bytes", "1024")
		for _, path := range []string{"/v1/messages", "/v1/messages?beta=true", "/v1/messages/count_tokens"} {
			status, h, body := p.do(t, http.MethodPost, path, msgs, "X-Api-Key", "sk-two")
			assertAnthropicError(t, status, h, body, http.StatusUnauthorized, "authentication_error")
			assert.NotEmpty(t, h.Get("Request-Id"), path)
			assert.Equal(t, h.Get("X-Request-Id"), h.Get("Request-Id"), path)
		}
		status, h, body := p.do(t, http.MethodPost, "/v1/messages", strings.Repeat("x", 2048), "Authorization", "Bearer sk-one")
		assertAnthropicError(t, status, h, body, http.StatusRequestEntityTooLarge, "request_too_large")
		status, h, body = p.do(t, http.MethodGet, "/v1/messages", "")
		assertAnthropicError(t, status, h, body, http.StatusMethodNotAllowed, "invalid_request_error")
		status, h, body = p.do(t, http.MethodPost, "/v1/messages/batches", msgs)
		assertAnthropicError(t, status, h, body, http.StatusNotFound, "not_found_error")

		// OpenAI's routes are unchanged, and carry no Request-Id.
		status, h, body = p.do(t, http.MethodPost, "/v1/chat/completions", chat, "Authorization", "Bearer sk-two")
		assertJSONError(t, status, h, body, http.StatusUnauthorized, "invalid_api_key")
		assert.Empty(t, h.Get("Request-Id"))
	})
	t.Run("shed", func(t *testing.T) {
		e := hangingEngine(t)
		p := startInProcess(t, nil, "--max-concurrent-turns", "1", "--prefill", e, "--decode", e)
		held := heldTurn(t, p, kvroute.PathMessages)
		defer held.Close()
		status, h, body := p.do(t, http.MethodPost, "/v1/messages?beta=true", msgs)
		assertAnthropicError(t, status, h, body, http.StatusServiceUnavailable, "overloaded_error")
		assert.Equal(t, "1", h.Get("Retry-After"))
		assert.Contains(t, body, "--max-concurrent-turns")
		status, h, body = p.do(t, http.MethodPost, "/v1/chat/completions", chat)
		assertJSONError(t, status, h, body, http.StatusServiceUnavailable, "overloaded")
	})
}

// Inbound keys are taken as Authorization: Bearer (OpenAI's SDKs, current
// Anthropic SDKs) or X-Api-Key (Anthropic's API header, which Claude Code
// and older Anthropic SDKs send), on every route that needs one.
func TestAPIKeyHeaders(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	p := startInProcess(t, nil, "--api-key", "sk-one", "--prefill", e.URL(), "--decode", e.URL())
	for _, tc := range []struct {
		name   string
		header []string
		want   int
	}{
		{"bearer", []string{"Authorization", "Bearer sk-one"}, http.StatusOK},
		{"x-api-key", []string{"X-Api-Key", "sk-one"}, http.StatusOK},
		{"wrong x-api-key", []string{"X-Api-Key", "sk-two"}, http.StatusUnauthorized},
		{"wrong bearer with the right x-api-key", []string{"Authorization", "Bearer sk-two", "X-Api-Key", "sk-one"}, http.StatusUnauthorized},
		{"none", nil, http.StatusUnauthorized},
	} {
		t.Run(tc.name, func(t *testing.T) {
			status, _, body := p.do(t, http.MethodGet, "/v1/models", "", tc.header...)
			assert.Equal(t, tc.want, status, body)
			status, _, body = p.do(t, http.MethodPost, "/v1/messages/count_tokens",
				`{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}`, tc.header...)
			assert.Equal(t, tc.want, status, body)
		})
	}
}

// POST /v1/messages/count_tokens (Anthropic's SDK messages.countTokens,
// which Claude Code calls, with ?beta=true) reaches an engine and its
// answer comes back as the engine gave it; it is no turn.
func TestCountTokens(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	p := startInProcess(t, nil, "--prefill", e.URL(), "--decode", e.URL(), "--max-body-bytes", "4096")
	body := `{"model":"sim-model","system":[{"type":"text","text":"You are terse."}],"messages":[{"role":"user","content":"How many tokens is this?"}]}`
	want, err := kvroutetest.CountTokens(kvroutetest.PathMessagesCountTokens, []byte(body))
	require.NoError(t, err)
	for _, path := range []string{"/v1/messages/count_tokens", "/v1/messages/count_tokens?beta=true"} {
		status, h, got := p.do(t, http.MethodPost, path, body, "Content-Type", "application/json", "Anthropic-Version", "2023-06-01")
		require.Equal(t, http.StatusOK, status, got)
		assert.Equal(t, "application/json", h.Get("Content-Type"))
		var r struct {
			InputTokens int `json:"input_tokens"`
		}
		require.NoError(t, json.Unmarshal([]byte(got), &r), got)
		assert.Equal(t, want, r.InputTokens, path)
	}
	// The engine's own 400 passes through in the engine's shape.
	status, _, got := p.do(t, http.MethodPost, "/v1/messages/count_tokens", `{"model":"sim-model"}`)
	assert.Equal(t, http.StatusBadRequest, status, got)
	status, h, got := p.do(t, http.MethodPost, "/v1/messages/count_tokens", `{"model":"sim-model","messages":"`+strings.Repeat("x", 5000)+`"}`)
	assertAnthropicError(t, status, h, got, http.StatusRequestEntityTooLarge, "request_too_large")
	_, _, page := p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "absent", metricValue(page, `bidikv_turns_total{path="/v1/messages",result="ok",reuse="miss"}`), "no turn")
	assert.Equal(t, "1", metricValue(page, `bidikv_rejected_requests_total{reason="too_large",status="413"}`))
}

// A Messages stream cut by the drain ends with Anthropic's error event
// (event: error, Anthropic's error body): Anthropic's SDKs skip events
// without an event name, so a bare data: line would end the stream
// silently, as if the message were whole.
func TestDrainCutsMessagesStream(t *testing.T) {
	t.Parallel() // slow: real processes or a long stream
	// Messages has no ignore_eos: a reply of about 16 tokens, slowed ten
	// times (about 3.5 s of decode).
	p := startEngine(t, "--profile", "qwen3-32b", "--speed", "0.1", "--no-enable-prefix-caching")
	d := startEngine(t, "--profile", "qwen3-32b", "--speed", "0.1")
	px := startProxy(t, p, d, "--shutdown-grace", "300ms")

	b := `{"model":"sim-model","max_tokens":400,"stream":true,"messages":[{"role":"user","content":"tell me a long story about a fox"}]}`
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, px.url+"/v1/messages?beta=true", strings.NewReader(b))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	r := bufio.NewReader(resp.Body)
	first, err := r.ReadString('\n')
	require.NoError(t, err)
	require.Equal(t, "event: message_start\n", first)

	require.NoError(t, px.cmd.Process.Signal(syscall.SIGTERM))
	rest, err := io.ReadAll(r)
	require.NoError(t, err, "the stream ends cleanly after its error event")
	assert.NotContains(t, string(rest), "message_stop")
	assert.Regexp(t, `\n\nevent: error\ndata: \{"type":"error","error":\{"type":"overloaded_error","message":"proxy: shutting down: [^"]+"\}\}\n\n$`, string(rest))
	select {
	case err := <-px.done:
		px.done <- err
		assert.Error(t, err, "the proxy exits non-zero")
	case <-time.After(time.Minute):
		require.FailNow(t, "the proxy did not exit")
	}
}

// Issue 21.22: the errors net/http answers itself, before any handler (a
// request it cannot parse), are in Anthropic's shape on /v1/messages and
// the paths below it too, as the proxy's and the router's own errors
// there are; other paths keep OpenAI's.
func TestMessagesNetHTTPErrorsInAnthropicShape(t *testing.T) {
	p := startInProcess(t, nil, "--max-header-bytes", "8192")
	for _, tc := range []struct {
		name, raw string
		status    int
		typ       string
	}{
		{"bad Content-Length", "POST /v1/messages HTTP/1.1\r\nHost: proxy\r\nContent-Length: abc\r\n\r\n", 400, "invalid_request_error"},
		{"two Content-Lengths", "POST /v1/messages?beta=true HTTP/1.1\r\nHost: proxy\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400, "invalid_request_error"},
		{"bad transfer encoding", "POST /v1/messages/count_tokens HTTP/1.1\r\nHost: proxy\r\nTransfer-Encoding: gzip, chunked\r\n\r\n", 501, "api_error"},
		{"no Host", "POST /v1/messages HTTP/1.1\r\nContent-Length: 0\r\n\r\n", 400, "invalid_request_error"},
		{"headers above net/http's limit", "POST /v1/messages HTTP/1.1\r\nHost: proxy\r\nX-Big: " + strings.Repeat("a", 40000) + "\r\n\r\n", 431, "invalid_request_error"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := p.dial(t)
			_, err := io.WriteString(c, tc.raw)
			require.NoError(t, err)
			resp, body := rawResponse(t, bufio.NewReader(c))
			assertAnthropicError(t, resp.StatusCode, resp.Header, body, tc.status, tc.typ)
		})
	}
	t.Run("after a request on the same connection", func(t *testing.T) {
		c := p.dial(t)
		r := bufio.NewReader(c)
		_, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
		require.NoError(t, err)
		resp, _ := rawResponse(t, r)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		_, err = io.WriteString(c, "POST /v1/messages HTTP/1.1\r\nHost: proxy\r\nContent-Length: x\r\n\r\n")
		require.NoError(t, err)
		resp, body := rawResponse(t, r)
		assertAnthropicError(t, resp.StatusCode, resp.Header, body, http.StatusBadRequest, "invalid_request_error")
	})
	t.Run("OpenAI's paths keep OpenAI's shape", func(t *testing.T) {
		c := p.dial(t)
		_, err := io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Length: abc\r\n\r\n")
		require.NoError(t, err)
		resp, body := rawResponse(t, bufio.NewReader(c))
		assertJSONError(t, resp.StatusCode, resp.Header, body, http.StatusBadRequest, "invalid_request")
	})
}
