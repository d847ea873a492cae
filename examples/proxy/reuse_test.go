package main

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// reuseSystem is long enough for a first turn's KV to be worth a pull.
const reuseSystem = "You are a coding agent working in a large Go repository. You can list files, read them, run the tests and edit code. " +
	"Think about the failing tests before you change anything, keep changes small, explain each step in one sentence, " +
	"and never invent file names: list the directory first. When the tests pass, summarise what you changed and why."

// plainChat is a non-streaming chat body of a system and a user message.
func plainChat(system, user string) string {
	b, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": 16,
		"messages": []map[string]string{{"role": "system", "content": system}, {"role": "user", "content": user}}})
	return string(b)
}

// chatAnswer reads the content of a non-streaming chat answer.
func chatAnswer(t *testing.T, body string) string {
	t.Helper()
	var b struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &b), body)
	require.NotEmpty(t, b.Choices, body)
	return b.Choices[0].Message.Content
}

// Issue 21.2, through the proxy's flags: with --key-mode conversation-id
// and --verification content, a tenant that sends a different, longer
// prompt under its old conversation id gets no reuse, and no tenant gets a
// wrong answer from a prefill engine that cached the old KV under that
// prompt's token hashes.
func TestConversationIDModeCannotPoison(t *testing.T) {
	for _, mode := range []string{"content", "tokens"} {
		t.Run(mode, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithRenderRoutes(mode == "content"))
			p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(),
				"--key-mode", "conversation-id", "--verification", mode, "--api-key", "key-a,key-b")
			other := "Different instructions: you review pull requests for a payments service written in Rust. " +
				strings.Repeat("Check every error path, every lock and every allocation before you approve. ", 5)
			turns := []struct {
				key, conv, body string
			}{
				{"key-a", "c1", plainChat(reuseSystem, "Turn 1: list the failing tests.")},
				{"key-a", "c1", withToolChoice(plainChat(other, "Turn 1: list the failing tests."), mode)},
				{"key-b", "", withToolChoice(plainChat(other, "Turn 1: list the failing tests."), mode)},
			}
			for i, tr := range turns {
				h := []string{"Authorization", "Bearer " + tr.key, "Content-Type", "application/json"}
				if tr.conv != "" {
					h = append(h, "X-Session-ID", tr.conv)
				}
				status, hdr, body := p.do(t, http.MethodPost, "/v1/chat/completions", tr.body, h...)
				require.Equal(t, http.StatusOK, status, "turn %d: %s", i, body)
				ref, err := kvroutetest.Reference("/v1/chat/completions", []byte(tr.body))
				require.NoError(t, err)
				assert.Equal(t, ref.Text, chatAnswer(t, body), "turn %d differs from a single engine's", i)
				if i > 0 {
					assert.NotEqual(t, "hit", hdr.Get("X-Bidikv-Reuse"), "turn %d", i)
				}
			}
			for _, e := range append(cl.Prefill, cl.Decode...) {
				assert.Zero(t, e.Stats().PoisonedHits, "poisoned prefix-cache hits")
				assert.Zero(t, e.Stats().WrongOutputs, "wrong outputs")
			}
		})
	}
}

// withToolChoice adds tool_choice in token mode, where the engines serve
// no render route and /tokenize cannot render it: verification falls back
// to content rules.
func withToolChoice(body, mode string) string {
	if mode != "tokens" {
		return body
	}
	return strings.TrimSuffix(body, "}") + `,"tool_choice":"none"}`
}

// Issue 21.8, through the proxy's flags: with --restart-check, a decode
// engine with a fixed engine id that restarted (and serves other
// conversations in the old block ids) never gets its old handle attached:
// the turn is a miss counted as engine_restarted, with a single engine's
// answer.
func TestRestartCheckFlag(t *testing.T) {
	reg := kvroutetest.NewRegistry()
	pe := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithEngineID("p-fixed"))
	de := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithEngineID("d-fixed"))
	// Every hit reads the engine's start again: the restart below is
	// instant, where a real one takes far longer than the default 1s.
	p := startInProcess(t, nil, "--prefill", pe.URL(), "--decode", de.URL(), "--restart-check", "1ns")
	msgs := []map[string]string{{"role": "system", "content": reuseSystem}}
	ask := func(text string) (string, string) {
		t.Helper()
		msgs = append(msgs, map[string]string{"role": "user", "content": text})
		b, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": 16, "messages": msgs})
		status, hdr, body := p.do(t, http.MethodPost, "/v1/chat/completions", string(b), "Content-Type", "application/json")
		require.Equal(t, http.StatusOK, status, body)
		ref, err := kvroutetest.Reference("/v1/chat/completions", b)
		require.NoError(t, err)
		answer := chatAnswer(t, body)
		assert.Equal(t, ref.Text, answer, "differs from a single engine's")
		msgs = append(msgs, map[string]string{"role": "assistant", "content": answer})
		return hdr.Get("X-Bidikv-Reuse"), body
	}
	ask("Turn 1: list the failing tests.")
	reuse, _ := ask("Turn 2: fix the first one.")
	require.Equal(t, "hit", reuse)
	de.Restart()
	other := plainChat("Another conversation. "+reuseSystem, "Turn 1: list the files.")
	status, _, body := p.do(t, http.MethodPost, "/v1/chat/completions", other, "Content-Type", "application/json")
	require.Equal(t, http.StatusOK, status, body)
	reuse, _ = ask("Turn 3: run the tests.")
	assert.Equal(t, "miss", reuse)
	_, _, page := p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "1", metricValue(page, `bidikv_reuse_misses_total{reason="engine_restarted"}`))
	assert.Equal(t, "1", metricValue(page, "bidikv_restarted_handles_total"))
	assert.Equal(t, "1", metricValue(page, "bidikv_decode_restarts_total"))
	for _, e := range []*kvroutetest.Engine{pe, de} {
		assert.Zero(t, e.Stats().WrongOutputs+e.Stats().FreedReads)
	}
}

// Issue 21.16, through the proxy's flags: a prefill engine whose render
// route hangs costs one turn --render-timeout, once: its breaker opens,
// and the conversation's later turns go on without asking it (verified by
// content rules), each with a single engine's answer.
func TestRenderTimeoutFlag(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	var calls atomic.Int32
	release := make(chan struct{})
	target, err := url.Parse(cl.Prefill[0].URL())
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(target)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !strings.HasSuffix(r.URL.Path, "/render") || r.Header.Get("User-Agent") == capability.UserAgent {
			rp.ServeHTTP(w, r) // the capability probe's calls are not turns'
			return
		}
		calls.Add(1)
		_, _ = io.Copy(io.Discard, r.Body) // so that a client that gives up is noticed
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(front.Close)
	t.Cleanup(func() { close(release) })
	p := startInProcess(t, nil, "--prefill", front.URL, "--decode", cl.Decode[0].URL(), "--render-timeout", "200ms")
	msgs := []map[string]string{{"role": "system", "content": reuseSystem}}
	for i := 1; i <= 6; i++ {
		msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Turn %d: go on with the plan.", i)})
		b, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": 16, "messages": msgs})
		status, _, body := p.do(t, http.MethodPost, "/v1/chat/completions", string(b), "Content-Type", "application/json")
		require.Equal(t, http.StatusOK, status, body)
		ref, err := kvroutetest.Reference("/v1/chat/completions", b)
		require.NoError(t, err)
		answer := chatAnswer(t, body)
		assert.Equal(t, ref.Text, answer)
		msgs = append(msgs, map[string]string{"role": "assistant", "content": answer})
	}
	assert.Equal(t, int32(1), calls.Load(), "render calls that reached the hung renderer")
	_, _, page := p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "1", metricValue(page, "bidikv_render_breaks_total"))
	assert.NotEqual(t, "0", metricValue(page, "bidikv_render_skipped_total"))
	assert.Zero(t, cl.Decode[0].Stats().WrongOutputs)
}

// Through the proxy's flags: with --key-mode conversation-id, DELETE
// /v1/conversations/{id} (the Conversations API's shape, behind the
// inbound keys) ends the caller's conversation: its next turn is a miss
// with a single engine's answer; another key's delete of the same id
// reaches nothing, and no key reaches none.
func TestDeleteConversationFlag(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(),
		"--key-mode", "conversation-id", "--api-key", "key-a,key-b")
	msgs := []map[string]string{{"role": "system", "content": reuseSystem}}
	ask := func(text string) string {
		t.Helper()
		msgs = append(msgs, map[string]string{"role": "user", "content": text})
		b, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": 16, "messages": msgs})
		status, hdr, body := p.do(t, http.MethodPost, "/v1/chat/completions", string(b),
			"Content-Type", "application/json", "Authorization", "Bearer key-a", "X-Session-ID", "c1")
		require.Equal(t, http.StatusOK, status, body)
		ref, err := kvroutetest.Reference("/v1/chat/completions", b)
		require.NoError(t, err)
		answer := chatAnswer(t, body)
		assert.Equal(t, ref.Text, answer, "differs from a single engine's")
		msgs = append(msgs, map[string]string{"role": "assistant", "content": answer})
		return hdr.Get("X-Bidikv-Reuse")
	}
	ask("Turn 1: list the failing tests.")
	status, _, body := p.do(t, http.MethodDelete, "/v1/conversations/c1", "")
	assert.Equal(t, http.StatusUnauthorized, status, body)
	status, _, body = p.do(t, http.MethodDelete, "/v1/conversations/c1", "", "Authorization", "Bearer key-b")
	require.Equal(t, http.StatusOK, status, body)
	assert.JSONEq(t, `{"id":"c1","object":"conversation.deleted","deleted":false}`, body)
	require.Equal(t, "hit", ask("Turn 2: fix the first one."), "another key's delete left it")
	status, _, body = p.do(t, http.MethodDelete, "/v1/conversations/c1", "", "Authorization", "Bearer key-a")
	require.Equal(t, http.StatusOK, status, body)
	assert.JSONEq(t, `{"id":"c1","object":"conversation.deleted","deleted":true}`, body)
	assert.NotEqual(t, "hit", ask("Turn 3: and the second."), "the deleted conversation's turn is a miss")
	status, hdr, _ := p.do(t, http.MethodGet, "/v1/conversations/c1", "", "Authorization", "Bearer key-a")
	assert.Equal(t, http.StatusMethodNotAllowed, status)
	assert.Equal(t, http.MethodDelete, hdr.Get("Allow"))
}
