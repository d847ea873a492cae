package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// agentSystem is the instructions (Codex) or system prompt (Claude Code):
// over 64 tokens, so turn 1's KV is worth a pull.
const agentSystem = "You are a coding agent working in a large Go repository. You can list files, read them, run the tests and edit code. " +
	"Think about the failing tests before you change anything, keep changes small, explain each step in one sentence, " +
	"and never invent file names: list the directory first. When the tests pass, summarise what you changed and why."

// agentAsk is the user's turn i of conversation conv.
func agentAsk(conv string, i int) string {
	return fmt.Sprintf("[%s] Turn %d: please look at the tool output below and continue the plan. The file has %d lines and the test suite reports %d failures in module m%d.",
		conv, i+1, 100+i*7, i%5, i)
}

// codexBody is the body Codex CLI sends besides input and stream (its
// current release pointed at a local server): store false, the session's
// prompt_cache_key, tools, reasoning and include.
func codexBody(session string) map[string]any {
	return map[string]any{
		"model": "sim-model", "instructions": agentSystem, "store": false,
		"tools": []any{map[string]any{"type": "function", "name": "shell", "description": "Runs a shell command.",
			"strict": false, "parameters": map[string]any{"type": "object", "properties": map[string]any{
				"command": map[string]any{"type": "array", "items": map[string]any{"type": "string"}}}, "required": []any{"command"}}}},
		"tool_choice": "auto", "parallel_tool_calls": false, "reasoning": map[string]any{"summary": "auto"},
		"include": []any{"reasoning.encrypted_content"}, "prompt_cache_key": session,
		"client_metadata": map[string]any{"x-codex-turn": "1"}, "max_output_tokens": 256,
	}
}

// claudeBody is the body Claude Code sends besides messages and stream.
func claudeBody(session string) map[string]any {
	return map[string]any{
		"model": "sim-model", "max_tokens": 256,
		"system":   []any{map[string]any{"type": "text", "text": agentSystem, "cache_control": map[string]any{"type": "ephemeral"}}},
		"thinking": map[string]any{"type": "adaptive"}, "context_management": map[string]any{"edits": []any{}},
		"output_config": map[string]any{"effort": "medium"},
		"metadata":      map[string]any{"user_id": "user_abc_account_x_session_" + session},
		"tools": []any{map[string]any{"name": "Bash", "description": "Run a command.",
			"input_schema": map[string]any{"type": "object", "properties": map[string]any{"command": map[string]any{"type": "string"}}, "required": []any{"command"}}}},
	}
}

// agentClient is one agent session: it resends its whole history each
// turn and echoes the assistant's output as it received it (Codex: the
// output message and function_call items, with their ids and annotations;
// Claude Code: the content blocks, text and tool_use; an OpenAI Agents
// SDK client on chat: the message with its tool_calls), then the results
// of the calls (function_call_output items, a user message of tool_result
// blocks, tool messages) or, after a reply without calls, the user's next
// words.
type agentClient struct {
	path, query string
	stream      bool
	session     string
	base        map[string]any
	items       []any                // Responses input items, Messages or chat messages
	ref         []kvroutetest.Option // the engines' options that shape answers
}

// runAgentTurns runs turns turns of c through the proxy at base, as its
// client sees them: each answers 200 with no handle member, ends with its
// final event, answers as a single engine would (text and tool calls),
// and reuses as hits says (every turn after the first hits, or none
// does); the assistant's output is echoed into the next turn, followed by
// its calls' results. It returns how many turns called a tool.
func runAgentTurns(t *testing.T, c *agentClient, client *http.Client, base, conv string, turns int, hits bool) int {
	t.Helper()
	calls := 0
	var last agentTurn
	for i := range turns {
		if i == 0 || len(last.calls) == 0 {
			c.ask(agentAsk(conv, i))
		} else {
			c.results(last, i)
		}
		got, body := c.turn(t, client, base, i)
		require.Equal(t, http.StatusOK, got.status, "turn %d: %s", i+1, got.raw)
		for _, s := range []string{"kv_transfer_params", "remote_block_ids", "remote_engine_id"} {
			assert.NotContains(t, got.raw, s, "turn %d: handles never reach the client", i+1)
		}
		assert.True(t, got.done, "turn %d ends with its final event", i+1)
		ref, err := kvroutetest.Reference(c.path, body, c.ref...)
		require.NoError(t, err)
		require.NotEmpty(t, ref.Text)
		assert.Equal(t, ref.Text, got.text, "turn %d answers as a single engine would", i+1)
		require.Len(t, got.calls, len(ref.ToolCalls), "turn %d calls the single engine's tools", i+1)
		for j, call := range ref.ToolCalls {
			assert.Equal(t, call.Name, got.calls[j].Name)
			assert.JSONEq(t, call.Arguments, got.calls[j].Arguments)
		}
		if len(got.calls) > 0 {
			calls++
		}
		want := "hit"
		if i == 0 || !hits {
			want = "miss"
		}
		assert.Equal(t, want, got.reuse, "turn %d (after a tool call: %v)", i+1, len(last.calls) > 0)
		require.NotEmpty(t, got.echo, "turn %d has an assistant item to echo", i+1)
		c.items = append(c.items, got.echo...)
		last = got
	}
	return calls
}

func (c *agentClient) responses() bool { return c.path == "/v1/responses" }

func (c *agentClient) chat() bool { return c.path == "/v1/chat/completions" }

// results appends the results of the calls of turn got, as each client
// sends them.
func (c *agentClient) results(got agentTurn, i int) {
	var blocks []any
	for j, id := range got.callIDs {
		out := fmt.Sprintf("$ go test ./...\nok  \tm%d\t0.%03ds (%d of %d)", i, 100+i*7, j+1, len(got.callIDs))
		switch {
		case c.responses():
			c.items = append(c.items, map[string]any{"type": "function_call_output", "call_id": id, "output": out})
		case c.chat():
			c.items = append(c.items, map[string]any{"role": "tool", "tool_call_id": id, "content": out})
		default:
			blocks = append(blocks, map[string]any{"type": "tool_result", "tool_use_id": id, "content": []any{map[string]any{"type": "text", "text": out}}})
		}
	}
	if blocks != nil {
		c.items = append(c.items, map[string]any{"role": "user", "content": blocks})
	}
}

func (c *agentClient) ask(text string) {
	if c.responses() {
		c.items = append(c.items, map[string]any{"type": "message", "role": "user",
			"content": []any{map[string]any{"type": "input_text", "text": text}}})
		return
	}
	c.items = append(c.items, map[string]any{"role": "user", "content": text})
}

func (c *agentClient) body() []byte {
	m := map[string]any{}
	for k, v := range c.base {
		m[k] = v
	}
	m["stream"] = c.stream
	switch {
	case c.responses():
		m["input"] = c.items
	case c.chat():
		m["messages"] = append([]any{map[string]any{"role": "system", "content": agentSystem}}, c.items...)
	default:
		m["messages"] = c.items
		// Claude Code's attribution line, first in its system prompt: a
		// hash that changes with every request (vLLM drops it before
		// rendering).
		sys, _ := m["system"].([]any)
		m["system"] = append([]any{map[string]any{"type": "text",
			"text": fmt.Sprintf("x-anthropic-billing-header: cc_version=2.0.50.%03x; cc_entrypoint=cli; cch=%05x;", len(c.items), len(c.items)*7919%0x100000)}}, sys...)
	}
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

// header is what the agent sends with every request.
func (c *agentClient) header(turn int) http.Header {
	h := http.Header{}
	h.Set("Content-Type", "application/json")
	if c.chat() {
		h.Set("User-Agent", "Agents/Python 0.6.1")
		return h
	}
	if c.responses() {
		h.Set("User-Agent", "codex_cli_rs/0.63.0 (Linux 6.8.0; x86_64) xterm-256color")
		h.Set("Originator", "codex_cli_rs")
		h.Set("OpenAI-Beta", "responses=experimental")
		h.Set("Session-Id", c.session)
		h.Set("Conversation-Id", c.session)
		h.Set("X-Client-Request-Id", fmt.Sprintf("%s-%d", c.session, turn))
		h.Set("Accept-Encoding", "zstd,gzip")
		if c.stream {
			h.Set("Accept", "text/event-stream")
		}
		return h
	}
	h.Set("User-Agent", "claude-cli/2.0.50 (external, cli)")
	h.Set("X-App", "cli")
	h.Set("Anthropic-Version", "2023-06-01")
	h.Set("Anthropic-Beta", "claude-code-20250219,interleaved-thinking-2025-05-14,fine-grained-tool-streaming-2025-05-14")
	h.Set("Anthropic-Dangerous-Direct-Browser-Access", "true")
	h.Set("X-Stainless-Lang", "js")
	h.Set("Accept", "application/json")
	return h
}

// agentTurn is one answer as the agent received it.
type agentTurn struct {
	status  int
	reuse   string
	raw     string // the status line's headers and every body byte
	text    string
	calls   []kvroutetest.ToolCall
	callIDs []string
	done    bool  // the final event (or a whole body) arrived
	echo    []any // what the agent appends to its history
}

// item reads a Responses output item: a message's text, a function call.
func (out *agentTurn) item(t *testing.T, raw json.RawMessage) {
	var it struct {
		Type      string     `json:"type"`
		Content   []textPart `json:"content"`
		CallID    string     `json:"call_id"`
		Name      string     `json:"name"`
		Arguments string     `json:"arguments"`
	}
	require.NoError(t, json.Unmarshal(raw, &it))
	switch it.Type {
	case "message":
		for _, p := range it.Content {
			out.text += p.Text
		}
	case "function_call":
		out.calls = append(out.calls, kvroutetest.ToolCall{Name: it.Name, Arguments: it.Arguments})
		out.callIDs = append(out.callIDs, it.CallID)
	default:
		return
	}
	out.echo = append(out.echo, raw) // Codex resends the item as it came
}

// blocks reads Messages content blocks: text and tool uses.
func (out *agentTurn) blocks(t *testing.T, content []json.RawMessage) {
	blocks := []any{}
	for _, raw := range content {
		var b struct {
			Type  string          `json:"type"`
			Text  string          `json:"text"`
			ID    string          `json:"id"`
			Name  string          `json:"name"`
			Input json.RawMessage `json:"input"`
		}
		require.NoError(t, json.Unmarshal(raw, &b))
		switch b.Type {
		case "text":
			out.text += b.Text
		case "tool_use":
			out.calls = append(out.calls, kvroutetest.ToolCall{Name: b.Name, Arguments: string(b.Input)})
			out.callIDs = append(out.callIDs, b.ID)
		}
		blocks = append(blocks, raw) // Claude Code resends the blocks
	}
	out.echo = []any{map[string]any{"role": "assistant", "content": blocks}}
}

// chatMessage reads a chat reply message and echoes it.
func (out *agentTurn) chatMessage(t *testing.T, content *string, calls []chatCall) {
	msg := map[string]any{"role": "assistant", "content": content}
	if content != nil {
		out.text = *content
	}
	for _, c := range calls {
		out.calls = append(out.calls, kvroutetest.ToolCall{Name: c.Function.Name, Arguments: c.Function.Arguments})
		out.callIDs = append(out.callIDs, c.ID)
	}
	if len(calls) > 0 {
		msg["tool_calls"] = calls
	}
	out.echo = []any{msg}
}

// chatCall is a chat tool call, whole or as a stream delta.
type chatCall struct {
	Index    int    `json:"index"`
	ID       string `json:"id,omitempty"`
	Type     string `json:"type,omitempty"`
	Function struct {
		Name      string `json:"name,omitempty"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// turn sends the history and reads the whole answer.
func (c *agentClient) turn(t *testing.T, client *http.Client, base string, i int) (agentTurn, []byte) {
	t.Helper()
	body := c.body()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+c.path+c.query, bytes.NewReader(body))
	require.NoError(t, err)
	req.Header = c.header(i)
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	var hdr strings.Builder
	require.NoError(t, resp.Header.Write(&hdr))
	out := agentTurn{status: resp.StatusCode, reuse: resp.Header.Get("X-Bidikv-Reuse"), raw: hdr.String() + "\r\n" + string(b)}
	if resp.StatusCode != http.StatusOK {
		return out, body
	}
	require.Empty(t, resp.Header.Get("Content-Encoding"), "the proxy answers uncompressed")
	if c.stream {
		require.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream"), resp.Header.Get("Content-Type"))
		c.readStream(t, b, &out)
	} else {
		require.True(t, strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json"), resp.Header.Get("Content-Type"))
		c.readBody(t, b, &out)
	}
	return out, body
}

type textPart struct {
	Type string `json:"type"`
	Text string `json:"text"`
}

func (c *agentClient) readBody(t *testing.T, b []byte, out *agentTurn) {
	t.Helper()
	out.done = true
	switch {
	case c.responses():
		var r struct {
			Status string            `json:"status"`
			Output []json.RawMessage `json:"output"`
		}
		require.NoError(t, json.Unmarshal(b, &r), "%s", b)
		for _, raw := range r.Output {
			out.item(t, raw)
		}
	case c.chat():
		var r struct {
			Choices []struct {
				Message struct {
					Content   *string    `json:"content"`
					ToolCalls []chatCall `json:"tool_calls"`
				} `json:"message"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal(b, &r), "%s", b)
		require.Len(t, r.Choices, 1)
		out.chatMessage(t, r.Choices[0].Message.Content, r.Choices[0].Message.ToolCalls)
	default:
		var m struct {
			Type    string            `json:"type"`
			Role    string            `json:"role"`
			Content []json.RawMessage `json:"content"`
		}
		require.NoError(t, json.Unmarshal(b, &m), "%s", b)
		require.Equal(t, "message", m.Type)
		out.blocks(t, m.Content)
	}
}

func (c *agentClient) readStream(t *testing.T, b []byte, out *agentTurn) {
	t.Helper()
	var blocks []map[string]any // Claude Code assembles the blocks from the events
	var content string          // the chat client assembles the message from the deltas
	var calls []chatCall
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			out.done = true
			continue
		}
		var ev struct {
			Type         string          `json:"type"`
			Delta        json.RawMessage `json:"delta"`
			Item         json.RawMessage `json:"item"`
			Index        int             `json:"index"`
			ContentBlock map[string]any  `json:"content_block"`
			Choices      []struct {
				Delta struct {
					Content   *string    `json:"content"`
					ToolCalls []chatCall `json:"tool_calls"`
				} `json:"delta"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ev), "%s", data)
		if c.chat() {
			if len(ev.Choices) == 0 {
				continue
			}
			d := ev.Choices[0].Delta
			if d.Content != nil {
				content += *d.Content
			}
			for _, tc := range d.ToolCalls {
				if tc.ID != "" {
					calls = append(calls, tc)
					continue
				}
				require.NotEmpty(t, calls, data)
				calls[len(calls)-1].Function.Arguments += tc.Function.Arguments
			}
			continue
		}
		switch ev.Type {
		case "response.output_item.done": // Codex keeps the finished items
			out.item(t, ev.Item)
		case "content_block_start":
			require.NotNil(t, ev.ContentBlock, data)
			for len(blocks) <= ev.Index {
				blocks = append(blocks, nil)
			}
			blocks[ev.Index] = ev.ContentBlock
		case "content_block_delta":
			var d struct {
				Type        string `json:"type"`
				Text        string `json:"text"`
				PartialJSON string `json:"partial_json"`
			}
			require.NoError(t, json.Unmarshal(ev.Delta, &d))
			require.Less(t, ev.Index, len(blocks), data)
			bl := blocks[ev.Index]
			switch d.Type {
			case "text_delta":
				bl["text"] = bl["text"].(string) + d.Text
			case "input_json_delta":
				s, _ := bl["partial_json"].(string)
				bl["partial_json"] = s + d.PartialJSON
			}
		case "response.completed", "message_stop":
			out.done = true
		case "error", "response.failed":
			require.FailNow(t, "error event", data)
		}
	}
	require.NoError(t, sc.Err())
	switch {
	case c.chat():
		out.chatMessage(t, &content, calls)
	case !c.responses():
		var content []json.RawMessage
		for _, bl := range blocks {
			if bl == nil {
				continue
			}
			if p, ok := bl["partial_json"].(string); ok {
				delete(bl, "partial_json")
				bl["input"] = json.RawMessage(p) // the tool's input, parsed
			}
			raw, err := json.Marshal(bl)
			require.NoError(t, err)
			content = append(content, raw)
		}
		out.blocks(t, content)
	}
}

// Coding agents through the proxy as real processes: four-turn sessions
// in the request shapes and headers Codex CLI (/v1/responses) and Claude
// Code (/v1/messages?beta=true, with its per-request billing header)
// send, streaming and not, each resending
// its whole history with the assistant's output echoed back (and, after
// a reply that called a tool, which the engines' default makes about
// half, the call's result). Turn 1
// misses and later turns hit (Messages streams carry no handle with
// vLLM, so they always miss), every answer is the single engine's, and
// no handle byte reaches the client.
func TestE2EAgents(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Parallel() // slow: real processes
	p := startEngine(t, "--no-enable-prefix-caching")
	d := startEngine(t)
	px := startProxy(t, p, d)
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)

	cases := []struct {
		name       string
		client     agentClient
		streamHits bool
	}{
		{"responses", agentClient{path: "/v1/responses", base: codexBody("0199a1b2-codex-body")}, true},
		{"responses stream", agentClient{path: "/v1/responses", stream: true, base: codexBody("0199a1b2-codex-stream")}, true},
		{"messages", agentClient{path: "/v1/messages", query: "?beta=true", base: claudeBody("body")}, true},
		{"messages stream", agentClient{path: "/v1/messages", query: "?beta=true", stream: true, base: claudeBody("stream")}, false},
	}
	const turns = 4
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.client
			c.session = tc.name
			if s, ok := c.base["prompt_cache_key"].(string); ok {
				c.session = s
			}
			calls := runAgentTurns(t, &c, client, px.url, tc.name, turns, tc.streamHits)
			t.Logf("%d of %d turns called a tool", calls, turns)
		})
	}

	t.Run("refused", func(t *testing.T) {
		for _, tc := range []struct{ path, body, want string }{
			{"/v1/responses", `{"model":"sim-model","input":"hi","store":false,"previous_response_id":"resp_1"}`, `"message":"kvroute: bad request: previous_response_id needs the response store of one server`},
			{"/v1/responses", `{"model":"sim-model","input":"hi","background":true}`, `"message":"kvroute: bad request: background responses are not supported`},
			{"/v1/messages?beta=true", `{"model":"sim-model","messages":[{"role":"user","content":"hi"}]}`, `{"type":"error","error":{"type":"invalid_request_error","message":"kvroute: bad request: max_tokens is required"}}`},
		} {
			resp, err := client.Post(px.url+tc.path, "application/json", strings.NewReader(tc.body))
			require.NoError(t, err)
			b, err := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			require.NoError(t, err)
			assert.Equal(t, http.StatusBadRequest, resp.StatusCode, "%s %s", tc.path, b)
			assert.Contains(t, string(b), tc.want, tc.path)
		}
	})

	status, page := get(t, px.url+"/metrics")
	require.Equal(t, http.StatusOK, status)
	for sample, want := range map[string]string{
		`bidikv_turns_total{path="/v1/responses",result="ok",reuse="hit"}`:  fmt.Sprint(2 * (turns - 1)),
		`bidikv_turns_total{path="/v1/responses",result="ok",reuse="miss"}`: "2",
		`bidikv_turns_total{path="/v1/messages",result="ok",reuse="hit"}`:   fmt.Sprint(turns - 1),
		`bidikv_turns_total{path="/v1/messages",result="ok",reuse="miss"}`:  fmt.Sprint(turns + 1),
		// Messages streams: nothing to retain, counted as streams without
		// a handle (per API under the missing capability), and no false
		// alarm of a decode engine that lost its handles.
		`bidikv_store_refusals_total{reason="no_stream_handle"}`:                               fmt.Sprint(turns),
		`bidikv_stream_without_handle_total`:                                                   fmt.Sprint(turns),
		`bidikv_missing_capability_turns_total{path="/v1/messages",reason="no_stream_handle"}`: fmt.Sprint(turns),
		`bidikv_decode_without_handle_total`:                                                   "0",
		`bidikv_handles_stored_total`:                                                          fmt.Sprint(3 * turns),
		`bidikv_token_fallbacks_total`:                                                         "0",
		`bidikv_inflight_turns`:                                                                "0",
	} {
		assert.Equal(t, want, metricValue(page, sample), sample)
	}
	assert.NotContains(t, px.stderr.String(), agentSystem[:40], "prompts never reach the logs")
}

// chatAgentBody is what an OpenAI Agents SDK client sends to
// /v1/chat/completions besides its messages and stream.
func chatAgentBody() map[string]any {
	return map[string]any{
		"model": "sim-model", "max_tokens": 256, "tool_choice": "auto", "parallel_tool_calls": false,
		"tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "run_shell", "description": "Run a shell command.",
			"parameters": map[string]any{"type": "object", "properties": map[string]any{"command": map[string]any{"type": "string"}}, "required": []any{"command"}}}}},
	}
}

// Agents in a tool loop through the proxy as real processes, on engines
// whose every reply under tool_choice auto calls a tool (--tool-call-rate
// 1): each turn after the first carries the previous turn's call and its
// result (function_call and function_call_output items; tool_use and
// tool_result blocks; an assistant message with tool_calls and tool
// messages) and reuses the KV the call left on D, on chat, Responses and
// Messages, streamed and not (Messages streams buffered, as their vLLM
// streams carry no handle). Every answer is the single engine's, text and
// calls, and no handle reaches the client; no turn is refused for its
// finish reason.
func TestE2EAgentToolCalls(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Parallel() // slow: real processes
	p := startEngine(t, "--no-enable-prefix-caching", "--tool-call-rate", "1")
	d := startEngine(t, "--tool-call-rate", "1")
	px := startProxy(t, p, d, "--decode-stream", "buffered:messages")
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)
	ref := []kvroutetest.Option{kvroutetest.WithToolCallRate(1)}
	cases := []struct {
		name   string
		client agentClient
	}{
		{"chat", agentClient{path: "/v1/chat/completions", base: chatAgentBody()}},
		{"chat stream", agentClient{path: "/v1/chat/completions", stream: true, base: chatAgentBody()}},
		{"responses", agentClient{path: "/v1/responses", base: codexBody("0199a1b2-codex-tools-body")}},
		{"responses stream", agentClient{path: "/v1/responses", stream: true, base: codexBody("0199a1b2-codex-tools-stream")}},
		{"messages", agentClient{path: "/v1/messages", query: "?beta=true", base: claudeBody("tools-body")}},
		{"messages stream", agentClient{path: "/v1/messages", query: "?beta=true", stream: true, base: claudeBody("tools-stream")}},
	}
	const turns = 4
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.client
			c.session, c.ref = tc.name, ref
			if s, ok := c.base["prompt_cache_key"].(string); ok {
				c.session = s
			}
			assert.Equal(t, turns, runAgentTurns(t, &c, client, px.url, tc.name, turns, true), "every turn calls a tool")
		})
	}
	status, page := get(t, px.url+"/metrics")
	require.Equal(t, http.StatusOK, status)
	for _, path := range []string{"/v1/chat/completions", "/v1/responses", "/v1/messages"} {
		assert.Equal(t, fmt.Sprint(2*(turns-1)), metricValue(page, `bidikv_turns_total{path="`+path+`",result="ok",reuse="hit"}`), path)
		assert.Equal(t, "2", metricValue(page, `bidikv_turns_total{path="`+path+`",result="ok",reuse="miss"}`), path)
	}
	assert.Equal(t, fmt.Sprint(6*turns), metricValue(page, "bidikv_handles_stored_total"), "every tool-call turn is retained")
	assert.NotContains(t, page, `reason="finish_`)
}

// The README's agent run, as written, only with free ports for the fixed
// ones: two Codex-shaped /v1/responses turns and two Claude Code-shaped
// /v1/messages turns (miss, then hit each) and the two refusals.
func TestReadmeAgents(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts processes")
	}
	t.Parallel() // slow: real processes
	got, _ := runReadmeBlock(t, "README.md", "agents")
	reuse := regexp.MustCompile(`(?mi)^x-bidikv-reuse: (\w+)\r?$`).FindAllStringSubmatch(got, -1)
	var seq []string
	for _, m := range reuse {
		seq = append(seq, strings.ToLower(m[1]))
	}
	assert.Equal(t, []string{"miss", "hit", "miss", "hit"}, seq, "%s", got)
	assert.Regexp(t, `(?m)^\{"error":\{"message":"kvroute: bad request: previous_response_id .*\}\} 400$`, got)
	assert.Regexp(t, `(?m)^\{"error":\{"message":"kvroute: bad request: background .*\}\} 400$`, got)
	assert.Regexp(t, `(?m)^bidikv_reuse_hits_total 2$`, got)
	for _, s := range []string{"kv_transfer_params", "remote_block_ids", "remote_engine_id"} {
		assert.NotContains(t, got, s)
	}
	lines := strings.Split(strings.TrimSpace(got), "\n")
	var answers []string
	for _, l := range lines {
		if !strings.Contains(l, ":") && !strings.HasPrefix(l, "{") && !strings.HasPrefix(l, "bidikv_") && strings.TrimSpace(l) != "" {
			answers = append(answers, l)
		}
	}
	assert.Len(t, answers, 4, "an answer text per turn:\n%s", got)
}
