package kvroute_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// agentText reads the assistant text of a Responses or Messages answer,
// body or stream, and whether the stream ended with its final event.
func agentText(t testing.TB, path string, raw []byte, stream bool) (string, bool) {
	t.Helper()
	if !stream {
		var b struct {
			Output []struct {
				Type    string `json:"type"`
				Content []struct {
					Type string `json:"type"`
					Text string `json:"text"`
				} `json:"content"`
			} `json:"output"`
			Content []struct {
				Type string `json:"type"`
				Text string `json:"text"`
			} `json:"content"`
		}
		require.NoError(t, json.Unmarshal(raw, &b), "%s", raw)
		var sb strings.Builder
		for _, it := range b.Output {
			if it.Type == "message" {
				for _, c := range it.Content {
					sb.WriteString(c.Text)
				}
			}
		}
		for _, c := range b.Content {
			if c.Type == "text" {
				sb.WriteString(c.Text)
			}
		}
		return sb.String(), true
	}
	var sb strings.Builder
	done := false
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		var ev struct {
			Type  string          `json:"type"`
			Delta json.RawMessage `json:"delta"`
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ev), "%s", data)
		switch ev.Type {
		case "response.output_text.delta":
			var s string
			require.NoError(t, json.Unmarshal(ev.Delta, &s))
			sb.WriteString(s)
		case "content_block_delta":
			var d struct {
				Type string `json:"type"`
				Text string `json:"text"`
			}
			require.NoError(t, json.Unmarshal(ev.Delta, &d))
			if d.Type == "text_delta" {
				sb.WriteString(d.Text)
			}
		case "response.completed", "message_stop":
			done = true
		}
	}
	return sb.String(), done
}

// agentConv is a client of the Responses or Messages API that resends
// its whole history, as Codex and Claude Code do.
type agentConv struct {
	path   string
	stream bool
	base   map[string]any // every other member of the body, as the agent sends it
	items  []any          // Responses input items or Messages messages
}

func (c *agentConv) say(text string) {
	if c.path == kvroute.PathResponses {
		c.items = append(c.items, map[string]any{"type": "message", "role": "user",
			"content": []any{map[string]any{"type": "input_text", "text": text}}})
		return
	}
	c.items = append(c.items, map[string]any{"role": "user", "content": text})
}

// hear appends the reply as the agent echoes it: Codex sends the output
// item back with its id, status and annotations; Claude Code the blocks.
func (c *agentConv) hear(text string, n int) {
	if c.path == kvroute.PathResponses {
		c.items = append(c.items, map[string]any{"type": "message", "role": "assistant", "id": fmt.Sprintf("msg_%d", n), "status": "completed",
			"content": []any{map[string]any{"type": "output_text", "text": text, "annotations": []any{}}}})
		return
	}
	c.items = append(c.items, map[string]any{"role": "assistant", "content": []any{map[string]any{"type": "text", "text": text}}})
}

func (c *agentConv) body() []byte {
	m := map[string]any{}
	for k, v := range c.base {
		m[k] = v
	}
	m["stream"] = c.stream
	if c.path == kvroute.PathResponses {
		m["input"] = c.items
	} else {
		m["messages"] = c.items
	}
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

// codexBase is the body Codex CLI sends besides its input (its current
// release pointed at a local server).
func codexBase() map[string]any {
	return map[string]any{
		"model": kvroutetest.DefaultModel, "instructions": systemPrompt, "store": false,
		"tools": []any{map[string]any{"type": "function", "name": "shell", "description": "Runs a shell command.",
			"parameters": map[string]any{"type": "object", "properties": map[string]any{"command": map[string]any{"type": "string"}}}}},
		"tool_choice": "auto", "parallel_tool_calls": false, "reasoning": map[string]any{"summary": "auto"},
		"include": []any{"reasoning.encrypted_content"}, "prompt_cache_key": "0199a1b2-codex-session",
		"client_metadata": map[string]any{"x": "y"}, "max_output_tokens": 48,
	}
}

// claudeBase is the body Claude Code sends besides its messages.
func claudeBase() map[string]any {
	return map[string]any{
		"model": kvroutetest.DefaultModel, "max_tokens": 48,
		"system":   []any{map[string]any{"type": "text", "text": systemPrompt, "cache_control": map[string]any{"type": "ephemeral"}}},
		"thinking": map[string]any{"type": "adaptive"}, "context_management": map[string]any{"edits": []any{}},
		"output_config": map[string]any{"effort": "medium"}, "metadata": map[string]any{"user_id": "user_abc_account_x_session_y"},
		"tools": []any{map[string]any{"name": "Bash", "description": "Run a command.", "input_schema": map[string]any{"type": "object", "properties": map[string]any{"command": map[string]any{"type": "string"}}}}},
	}
}

// Multi-turn agent conversations over /v1/responses and /v1/messages
// through the Router, streaming and not, in the request shapes Codex and
// Claude Code send: turn 1 misses, later turns reuse the verified prefix
// (Messages streams carry no handle, so they miss), every answer is the
// single engine's, and no handle byte reaches the client.
func TestAgentAPIs(t *testing.T) {
	cases := []struct {
		name    string
		path    string
		stream  bool
		base    func() map[string]any
		header  http.Header
		reuses  bool
		urlTail string
	}{
		{"responses body", kvroute.PathResponses, false, codexBase, http.Header{"Session-Id": {"s1"}}, true, ""},
		{"responses stream", kvroute.PathResponses, true, codexBase, http.Header{"Session-Id": {"s1"}, "Accept-Encoding": {"zstd,gzip"}}, true, ""},
		{"messages body", kvroute.PathMessages, false, claudeBase, http.Header{"Anthropic-Version": {"2023-06-01"}, "Anthropic-Beta": {"interleaved-thinking-2025-05-14"}}, true, "?beta=true"},
		{"messages stream", kvroute.PathMessages, true, claudeBase, http.Header{"Anthropic-Version": {"2023-06-01"}}, false, "?beta=true"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
			rec := &kvroutetest.Records{}
			r := newRouter(t, c, kvroute.WithObserver(rec))
			url := serve(t, r)
			conv := &agentConv{path: tc.path, stream: tc.stream, base: tc.base()}
			for turn := range 5 {
				conv.say(userText(turn))
				body := conv.body()
				res := send(t, url, tc.path+tc.urlTail, body, tc.header)
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
				assert.NotContains(t, string(res.raw), "remote_block_ids")
				text, done := agentText(t, tc.path, res.raw, tc.stream)
				assert.True(t, done, "the stream ended with its final event")
				ref, err := kvroutetest.Reference(tc.path, body)
				require.NoError(t, err)
				assert.Equal(t, ref.Text, text, "turn %d differs from the single engine", turn)
				tr := rec.Last()
				if turn == 0 || !tc.reuses {
					assert.Equal(t, kvroute.ReuseMiss, tr.Reuse, "turn %d", turn)
				} else {
					require.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d: %s (stored before: %v)", turn, tr.MissReason, tr.StoreRefusal)
					assert.Equal(t, kvroute.VerifyTokens, tr.Verification)
					assert.True(t, tr.Partial, "only the rendered prompt is verified")
					assert.Positive(t, tr.ReusableTokens)
					t.Logf("turn %d: reused %d of %d handle tokens (prompt %d)", turn, tr.ReusableTokens, tr.HandleTokens, tr.PromptTokens)
				}
				conv.hear(text, turn)
			}
			for _, e := range append(c.Prefill, c.Decode...) {
				assert.Zero(t, e.Stats().WrongOutputs)
				assert.Zero(t, e.Stats().FreedReads)
			}
		})
	}
}

// Errors on /v1/messages are in Anthropic's shape; stateful Responses
// features are refused with a clear 400.
func TestAgentAPIErrors(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	r := newRouter(t, c)
	url := serve(t, r)
	res := send(t, url, kvroute.PathMessages, []byte(`{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}`), nil)
	assert.Equal(t, http.StatusBadRequest, res.status)
	var ae struct {
		Type  string `json:"type"`
		Error struct {
			Type    string `json:"type"`
			Message string `json:"message"`
		} `json:"error"`
	}
	require.NoError(t, json.Unmarshal(res.raw, &ae), "%s", res.raw)
	assert.Equal(t, "error", ae.Type)
	assert.Equal(t, "invalid_request_error", ae.Error.Type)
	assert.Contains(t, ae.Error.Message, "max_tokens")

	res = send(t, url, kvroute.PathResponses, []byte(`{"model":"sim-model","input":"hi","previous_response_id":"resp_1"}`), nil)
	assert.Equal(t, http.StatusBadRequest, res.status)
	assert.Contains(t, string(res.raw), "previous_response_id")
	assert.Contains(t, string(res.raw), `"error"`)
}

// Claude Code moves its cache_control breakpoint to the newest message
// every turn and may send a message as a string or as text blocks: neither
// changes which conversation a request belongs to.
func TestAgentAnchorIgnoresCacheControl(t *testing.T) {
	sys := []any{map[string]any{"type": "text", "text": systemPrompt, "cache_control": map[string]any{"type": "ephemeral"}}}
	first := func(content any) map[string]any { return map[string]any{"role": "user", "content": content} }
	body := func(msgs ...any) []byte {
		b, err := json.Marshal(map[string]any{"model": "m", "max_tokens": 8, "system": sys, "messages": msgs})
		require.NoError(t, err)
		return b
	}
	turn1 := body(first([]any{map[string]any{"type": "text", "text": "fix the bug", "cache_control": map[string]any{"type": "ephemeral"}}}))
	turn2 := body(first([]any{map[string]any{"type": "text", "text": "fix the bug"}}),
		map[string]any{"role": "assistant", "content": []any{map[string]any{"type": "text", "text": "done"}}},
		first([]any{map[string]any{"type": "text", "text": "now the tests", "cache_control": map[string]any{"type": "ephemeral"}}}))
	asString := body(first("fix the bug"))
	other := body(first("fix another bug"))
	keys := func(b []byte) []string {
		k, err := kvroute.ContinuationKeys{}.Lookup(&kvroute.Request{Path: kvroute.PathMessages, Body: b})
		require.NoError(t, err)
		require.Len(t, k.Keys, 1)
		return k.Keys
	}
	assert.Equal(t, keys(turn1), keys(turn2), "a moved breakpoint")
	assert.Equal(t, keys(turn1), keys(asString), "string or blocks")
	assert.NotEqual(t, keys(turn1), keys(other), "another conversation")
}

// Issue 21.21: a Responses answer echoes the request's metadata, tools and
// text; a member there named kv_transfer_params or as a handle's members
// are would make every decode answer fail closed. Such a request is
// refused up front with 400, before any engine is asked (it was a 502
// after three full prefill and decode attempts).
func TestResponsesReservedNames(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	r := newRouter(t, c)
	url := newServer(t, r) // the words are the client's: no leak guard
	tool := func(props string) string {
		return `"tools":[{"type":"function","name":"f","parameters":{"type":"object","properties":` + props + `}}]`
	}
	for _, extra := range []string{
		`"metadata":{"kv_transfer_params":"x"}`,
		`"metadata":{"\u006bv_transfer_params":"x"}`,
		tool(`{"kv_transfer_params":{"type":"string"}}`),
		tool(`{"remote_engine_id":{"type":"string"}}`),
		`"text":{"format":{"type":"json_schema","name":"s","schema":{"type":"object","properties":{"remote_block_ids":{"type":"array"}}}}}`,
	} {
		for _, stream := range []bool{false, true} {
			before := len(c.Prefill[0].Requests()) + len(c.Decode[0].Requests())
			body := `{"model":"` + kvroutetest.DefaultModel + `","input":"hi","max_output_tokens":4,"stream":` + fmt.Sprint(stream) + `,` + extra + `}`
			res := send(t, url, kvroute.PathResponses, []byte(body), nil)
			assert.Equal(t, http.StatusBadRequest, res.status, "%s: %s", extra, res.raw)
			assert.Contains(t, string(res.raw), "reserved", extra)
			assert.Equal(t, before, len(c.Prefill[0].Requests())+len(c.Decode[0].Requests()), "no engine is asked: %s", extra)
		}
	}
	// The same words as text, or a top-level kv_transfer_params (always
	// replaced), are no reason to refuse.
	for _, extra := range []string{`"metadata":{"note":"kv_transfer_params remote_engine_id"}`, `"kv_transfer_params":{"do_remote_decode":true}`} {
		body := `{"model":"` + kvroutetest.DefaultModel + `","input":"hi","max_output_tokens":4,` + extra + `}`
		res := send(t, url, kvroute.PathResponses, []byte(body), nil)
		assert.Equal(t, http.StatusOK, res.status, "%s: %s", extra, res.raw)
	}
}

// Issue 21.22: what the Router's handler answers before any turn (a wrong
// method, a body over WithMaxBodyBytes, a body that is not JSON, a path
// below /v1/messages it does not serve) is in Anthropic's shape on
// Anthropic's paths.
func TestMessagesHandlerErrorsInAnthropicShape(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	r := newRouter(t, c, kvroute.WithLimits(kvroute.Limits{Body: 256}))
	url := newServer(t, r)
	for _, tc := range []struct {
		method, path, body string
		status             int
		typ                string
	}{
		{http.MethodGet, "/v1/messages", "", http.StatusMethodNotAllowed, "invalid_request_error"},
		{http.MethodPost, "/v1/messages", strings.Repeat("x", 300), http.StatusRequestEntityTooLarge, "request_too_large"},
		{http.MethodPost, "/v1/messages?beta=true", `{"model":`, http.StatusBadRequest, "invalid_request_error"},
		{http.MethodPost, "/v1/messages/batches", `{}`, http.StatusNotFound, "not_found_error"},
	} {
		req, err := http.NewRequest(tc.method, url+tc.path, strings.NewReader(tc.body))
		require.NoError(t, err)
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		raw, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		assert.Equal(t, tc.status, resp.StatusCode, "%s %s", tc.method, tc.path)
		var ae struct {
			Type  string `json:"type"`
			Error struct{ Type, Message string }
		}
		require.NoError(t, json.Unmarshal(raw, &ae), "%s", raw)
		assert.Equal(t, "error", ae.Type, "%s %s: %s", tc.method, tc.path, raw)
		assert.Equal(t, tc.typ, ae.Error.Type, "%s %s: %s", tc.method, tc.path, raw)
	}
}

// billingBlock is the text block Claude Code puts first in its system
// prompt: an attribution line whose hash changes with every request.
func billingBlock(n int) map[string]any {
	return map[string]any{"type": "text", "text": fmt.Sprintf("x-anthropic-billing-header: cc_version=2.1.77.%03x; cc_entrypoint=cli; cch=%05x;", n, n*7919)}
}

// vLLM drops Claude Code's billing header before rendering
// (vllm/entrypoints/anthropic/serving.py): the anchor does too, so it
// does not make every turn look like a new conversation. Texts vLLM
// renders still count.
func TestAgentAnchorIgnoresBillingHeader(t *testing.T) {
	sys := func(blocks ...any) any { return blocks }
	text := map[string]any{"type": "text", "text": systemPrompt}
	user := map[string]any{"role": "user", "content": "fix the bug"}
	keys := func(path string, m map[string]any) string {
		if _, ok := m["messages"]; !ok && path == kvroute.PathMessages {
			m["messages"] = []any{user}
		}
		m["model"], m["max_tokens"] = "m", 8
		b, err := json.Marshal(m)
		require.NoError(t, err)
		k, err := kvroute.ContinuationKeys{}.Lookup(&kvroute.Request{Path: path, Body: b})
		require.NoError(t, err)
		require.Len(t, k.Keys, 1)
		return k.Keys[0]
	}
	msgs := kvroute.PathMessages
	base := keys(msgs, map[string]any{"system": sys(text)})
	assert.Equal(t, base, keys(msgs, map[string]any{"system": sys(billingBlock(1), text)}), "a billing block")
	assert.Equal(t, keys(msgs, map[string]any{"system": sys(billingBlock(1), text)}), keys(msgs, map[string]any{"system": sys(billingBlock(2), text)}), "another request's hash")
	assert.Equal(t, base, keys(msgs, map[string]any{"system": sys(text, map[string]any{"type": "text", "text": ""})}), "an empty block")
	inline := func(content any) map[string]any {
		return map[string]any{"system": sys(text), "messages": []any{map[string]any{"role": "system", "content": content}, user}}
	}
	assert.Equal(t, keys(msgs, inline([]any{billingBlock(1)})), keys(msgs, inline([]any{billingBlock(2)})), "in a system message's blocks")
	assert.Equal(t, keys(msgs, inline(billingBlock(1)["text"])), keys(msgs, inline(billingBlock(2)["text"])), "as a system message's string")
	// What vLLM renders keeps counting.
	assert.NotEqual(t, keys(msgs, map[string]any{"system": billingBlock(1)["text"]}), keys(msgs, map[string]any{"system": billingBlock(2)["text"]}),
		"a top-level system string is rendered as it is")
	assert.NotEqual(t, base, keys(msgs, map[string]any{"system": sys(map[string]any{"type": "text", "text": "You are terse."})}))
	assert.NotEqual(t, keys(msgs, map[string]any{"system": sys(text), "messages": []any{map[string]any{"role": "user", "content": billingBlock(1)["text"]}}}),
		keys(msgs, map[string]any{"system": sys(text), "messages": []any{map[string]any{"role": "user", "content": billingBlock(2)["text"]}}}),
		"a user's text is rendered whatever it starts with")
	resp := kvroute.PathResponses
	assert.NotEqual(t, keys(resp, map[string]any{"instructions": billingBlock(1)["text"], "input": "hi"}),
		keys(resp, map[string]any{"instructions": billingBlock(2)["text"], "input": "hi"}), "only the Messages API drops it")
}

// Claude Code's conversations reuse KV from turn 2 although the billing
// header in their system prompt changes every request; every answer is
// the single engine's.
func TestClaudeCodeBillingHeaderHits(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	rec := &kvroutetest.Records{}
	url := serve(t, newRouter(t, c, kvroute.WithObserver(rec)))
	conv := &agentConv{path: kvroute.PathMessages, base: claudeBase()}
	system := conv.base["system"].([]any)
	for turn := range 4 {
		conv.base["system"] = append([]any{billingBlock(turn)}, system...)
		conv.say(userText(turn))
		body := conv.body()
		res := send(t, url, kvroute.PathMessages+"?beta=true", body, http.Header{"Anthropic-Version": {"2023-06-01"}})
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		text, _ := agentText(t, kvroute.PathMessages, res.raw, false)
		ref, err := kvroutetest.Reference(kvroute.PathMessages, body)
		require.NoError(t, err)
		assert.Equal(t, ref.Text, text, "turn %d", turn)
		tr := rec.Last()
		if turn == 0 {
			assert.Equal(t, kvroute.ReuseMiss, tr.Reuse)
		} else {
			assert.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d: %s", turn, tr.MissReason)
		}
		conv.hear(text, turn)
	}
}
