package kvroute_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// toolClient is an agent in a tool loop over chat, Responses or Messages:
// it resends its whole history, echoes the assistant's turn as its
// client library keeps it (chat: the message with content and
// tool_calls; Responses: the output items, streamed the
// output_item.done items; Messages: the content blocks, streamed
// assembled from their events), then sends each call's result (a tool
// message, a function_call_output item, a user message of tool_result
// blocks) or, after a reply without calls, the user's next words.
type toolClient struct {
	path   string
	stream bool
	items  []any
}

// toolReply is an answer as the client reads it.
type toolReply struct {
	text   string
	finish string // chat finish_reason, Messages stop_reason, Responses status
	calls  []kvroutetest.ToolCall
	ids    []string
	echo   []any // what the client appends to its history
	done   bool
}

func (c *toolClient) body() []byte {
	params := map[string]any{"type": "object", "properties": map[string]any{"command": map[string]any{"type": "string"}}}
	m := map[string]any{"model": kvroutetest.DefaultModel, "stream": c.stream}
	switch c.path {
	case kvroute.PathChatCompletions:
		m["messages"], m["max_tokens"] = append([]any{map[string]any{"role": "system", "content": systemPrompt}}, c.items...), 200
		m["tools"] = []any{map[string]any{"type": "function", "function": map[string]any{"name": "shell", "parameters": params}}}
		m["tool_choice"] = "auto"
	case kvroute.PathResponses:
		m["instructions"], m["input"], m["max_output_tokens"], m["store"] = systemPrompt, c.items, 200, false
		m["tools"] = []any{map[string]any{"type": "function", "name": "shell", "parameters": params}}
		m["tool_choice"], m["parallel_tool_calls"] = "auto", false
	default:
		m["system"], m["messages"], m["max_tokens"] = systemPrompt, c.items, 200
		m["tools"] = []any{map[string]any{"name": "Bash", "input_schema": params}}
	}
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

// next appends the input that follows reply r (the tools' results, or the
// user's words after a reply without calls, or to begin).
func (c *toolClient) next(r *toolReply, turn int) {
	if r != nil {
		c.items = append(c.items, r.echo...)
	}
	if r == nil || len(r.calls) == 0 {
		text := userText(turn)
		if c.path == kvroute.PathResponses {
			c.items = append(c.items, map[string]any{"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": text}}})
		} else {
			c.items = append(c.items, map[string]any{"role": "user", "content": text})
		}
		return
	}
	var results []any
	for i, id := range r.ids {
		out := fmt.Sprintf("exit 0: %d files changed, the tests of module m%d pass", turn+i, turn)
		switch c.path {
		case kvroute.PathChatCompletions:
			c.items = append(c.items, map[string]any{"role": "tool", "tool_call_id": id, "content": out})
		case kvroute.PathResponses:
			c.items = append(c.items, map[string]any{"type": "function_call_output", "call_id": id, "output": out})
		default:
			results = append(results, map[string]any{"type": "tool_result", "tool_use_id": id, "content": out})
		}
	}
	if results != nil {
		c.items = append(c.items, map[string]any{"role": "user", "content": results})
	}
}

// read reads an answer, body or stream.
func (c *toolClient) read(t *testing.T, raw []byte) toolReply {
	t.Helper()
	if !c.stream {
		return c.readBody(t, raw)
	}
	var r toolReply
	var chat struct {
		content string
		calls   []map[string]any
	}
	var blocks []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(make([]byte, 1<<20), 1<<24)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			r.done = true
			continue
		}
		var ev map[string]any
		require.NoError(t, json.Unmarshal([]byte(data), &ev), data)
		switch c.path {
		case kvroute.PathChatCompletions:
			choices, _ := ev["choices"].([]any)
			if len(choices) == 0 {
				continue
			}
			ch := choices[0].(map[string]any)
			if f, ok := ch["finish_reason"].(string); ok {
				r.finish = f
			}
			d, _ := ch["delta"].(map[string]any)
			if s, ok := d["content"].(string); ok {
				chat.content += s
			}
			tcs, _ := d["tool_calls"].([]any)
			for _, x := range tcs {
				tc := x.(map[string]any)
				fn := tc["function"].(map[string]any)
				if id, ok := tc["id"].(string); ok && id != "" {
					chat.calls = append(chat.calls, map[string]any{"id": id, "type": "function",
						"function": map[string]any{"name": fn["name"], "arguments": ""}})
				}
				last := chat.calls[len(chat.calls)-1]["function"].(map[string]any)
				last["arguments"] = last["arguments"].(string) + fn["arguments"].(string)
			}
		case kvroute.PathResponses:
			switch ev["type"] {
			case "response.output_item.done":
				r.item(ev["item"].(map[string]any))
				r.echo = append(r.echo, ev["item"])
			case "response.completed":
				r.finish, r.done = ev["response"].(map[string]any)["status"].(string), true
			}
		default:
			switch ev["type"] {
			case "content_block_start":
				blocks = append(blocks, ev["content_block"].(map[string]any))
			case "content_block_delta":
				b := blocks[int(ev["index"].(float64))]
				d := ev["delta"].(map[string]any)
				switch d["type"] {
				case "text_delta":
					b["text"] = b["text"].(string) + d["text"].(string)
				case "input_json_delta":
					s, _ := b["partial"].(string)
					b["partial"] = s + d["partial_json"].(string)
				}
			case "message_delta":
				r.finish = ev["delta"].(map[string]any)["stop_reason"].(string)
			case "message_stop":
				r.done = true
			}
		}
	}
	require.NoError(t, sc.Err())
	switch c.path {
	case kvroute.PathChatCompletions:
		r.chatMessage(map[string]any{"role": "assistant", "content": chat.content, "tool_calls": anySlice(chat.calls)})
	case kvroute.PathMessages:
		for _, b := range blocks {
			if p, ok := b["partial"].(string); ok {
				delete(b, "partial")
				b["input"] = json.RawMessage(p) // Claude Code parses the input
			}
		}
		r.messagesContent(anySlice(blocks))
	}
	return r
}

func anySlice[T any](in []T) []any {
	out := make([]any, len(in))
	for i, v := range in {
		out[i] = v
	}
	return out
}

func (c *toolClient) readBody(t *testing.T, raw []byte) toolReply {
	t.Helper()
	r := toolReply{done: true}
	var b map[string]any
	require.NoError(t, json.Unmarshal(raw, &b), "%s", raw)
	switch c.path {
	case kvroute.PathChatCompletions:
		ch := b["choices"].([]any)[0].(map[string]any)
		r.finish = ch["finish_reason"].(string)
		msg := ch["message"].(map[string]any)
		r.chatMessage(msg)
	case kvroute.PathResponses:
		r.finish = b["status"].(string)
		for _, it := range b["output"].([]any) {
			r.item(it.(map[string]any))
			r.echo = append(r.echo, it) // Codex resends the items as they came
		}
	default:
		r.finish = b["stop_reason"].(string)
		r.messagesContent(b["content"].([]any))
	}
	return r
}

func (r *toolReply) chatMessage(msg map[string]any) {
	r.text, _ = msg["content"].(string)
	tcs, _ := msg["tool_calls"].([]any)
	for _, x := range tcs {
		tc := x.(map[string]any)
		fn := tc["function"].(map[string]any)
		r.calls = append(r.calls, kvroutetest.ToolCall{Name: fn["name"].(string), Arguments: fn["arguments"].(string)})
		r.ids = append(r.ids, tc["id"].(string))
	}
	echo := map[string]any{"role": "assistant", "content": msg["content"]}
	if len(tcs) > 0 {
		echo["tool_calls"] = tcs
	}
	r.echo = []any{echo}
}

func (r *toolReply) item(it map[string]any) {
	switch it["type"] {
	case "message":
		for _, p := range it["content"].([]any) {
			r.text += p.(map[string]any)["text"].(string)
		}
	case "function_call":
		r.calls = append(r.calls, kvroutetest.ToolCall{Name: it["name"].(string), Arguments: it["arguments"].(string)})
		r.ids = append(r.ids, it["call_id"].(string))
	}
}

func (r *toolReply) messagesContent(blocks []any) {
	for _, x := range blocks {
		b := x.(map[string]any)
		switch b["type"] {
		case "text":
			r.text += b["text"].(string)
		case "tool_use":
			in, _ := json.Marshal(b["input"])
			r.calls = append(r.calls, kvroutetest.ToolCall{Name: b["name"].(string), Arguments: string(in)})
			r.ids = append(r.ids, b["id"].(string))
		}
	}
	r.echo = []any{map[string]any{"role": "assistant", "content": blocks}}
}

// sameCalls compares calls by name and by the arguments' JSON value.
func sameCalls(t *testing.T, want, got []kvroutetest.ToolCall) {
	t.Helper()
	require.Len(t, got, len(want))
	for i := range want {
		assert.Equal(t, want[i].Name, got[i].Name)
		assert.JSONEq(t, want[i].Arguments, got[i].Arguments)
	}
}

// Agents' tool-call turns are retained and reused, in every API, streamed
// and not: with tool_choice auto every reply of these engines ends in a
// call (chat finish_reason tool_calls, Messages stop_reason tool_use, a
// Responses function_call item), and the next turn, which carries the
// call and its result, reuses the KV the call left on the decode engine.
// Chat's is verified token for token (the call renders back as the tokens
// D generated: a whole hit), also by the content rules; Responses and
// Messages verify the rendered prompt (partial hits). Every answer is the
// single engine's, and no handle reaches the client. (Before, a chat
// tool_calls finish was refused as "finish_tool_calls": no agent turn was
// ever reused, and D pinned each such hold to its TTL.)
func TestToolCallTurnsReuse(t *testing.T) {
	cases := []struct {
		name    string
		path    string
		stream  bool
		opts    []kvroute.Option
		partial bool
	}{
		{"chat", kvroute.PathChatCompletions, false, nil, false},
		{"chat stream", kvroute.PathChatCompletions, true, nil, false},
		{"chat content mode", kvroute.PathChatCompletions, false, []kvroute.Option{kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent})}, false},
		{"chat stream content mode", kvroute.PathChatCompletions, true, []kvroute.Option{kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent})}, false},
		{"responses", kvroute.PathResponses, false, nil, true},
		{"responses stream", kvroute.PathResponses, true, nil, true},
		{"messages", kvroute.PathMessages, false, nil, true},
		{"messages stream (buffered)", kvroute.PathMessages, true,
			[]kvroute.Option{kvroute.WithDecodeMemory(kvroute.DecodeMemory{BufferStreams: []string{kvroute.PathMessages}})}, true},
	}
	ref := []kvroutetest.Option{kvroutetest.WithToolCallRate(1)}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithToolCallRate(1))
			rec := &kvroutetest.Records{}
			url := serve(t, newRouter(t, c, append([]kvroute.Option{kvroute.WithObserver(rec)}, tc.opts...)...))
			client := &toolClient{path: tc.path, stream: tc.stream}
			var last *toolReply
			for turn := range 5 {
				client.next(last, turn)
				body := client.body()
				res := send(t, url, tc.path, body, nil)
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
				for _, s := range []string{"kv_transfer_params", "remote_block_ids", "remote_engine_id"} {
					assert.NotContains(t, string(res.raw), s, "turn %d: handles never reach the client", turn)
				}
				got := client.read(t, res.raw)
				assert.True(t, got.done, "turn %d ends with its final event", turn)
				want, err := kvroutetest.Reference(tc.path, body, ref...)
				require.NoError(t, err)
				assert.Equal(t, want.Text, got.text, "turn %d: the single engine's text", turn)
				require.NotEmpty(t, want.ToolCalls, "turn %d: the reply calls a tool", turn)
				sameCalls(t, want.ToolCalls, got.calls)
				assert.Equal(t, map[string]string{kvroute.PathChatCompletions: "tool_calls", kvroute.PathMessages: "tool_use",
					kvroute.PathResponses: "completed"}[tc.path], got.finish, "turn %d", turn)

				tr := rec.Last()
				assert.True(t, tr.Stored, "turn %d: the tool-call turn is retained (%s)", turn, tr.StoreRefusal)
				if turn == 0 {
					assert.Equal(t, kvroute.ReuseMiss, tr.Reuse)
				} else {
					require.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d, after a tool call: %s", turn, tr.MissReason)
					assert.Equal(t, tc.partial, tr.Partial, "turn %d", turn)
					if !tc.partial {
						assert.Equal(t, tr.HandleTokens, tr.ReusableTokens, "turn %d: everything D holds is reused", turn)
					}
				}
				last = &got
			}
			for _, e := range append(c.Prefill, c.Decode...) {
				assert.Zero(t, e.Stats().WrongOutputs)
				assert.Zero(t, e.Stats().FreedReads)
			}
		})
	}
}

// A buffered Messages stream is D's non-streamed answer written as the
// API's stream, so a tool call cut by max_tokens, which the engine's own
// stream would have begun (its name, the arguments so far), is left out as
// the body leaves it out, and the stream says stop_reason max_tokens. The
// agent's next turn then carries the history of the non-streamed answer.
// Every max_tokens from 1 to 40 is tried; some cut the call (the streamed
// and non-streamed references differ there) and each answer is the
// non-streamed one.
func TestBufferedStreamCutToolCall(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithToolCallRate(1))
	url := serve(t, newRouter(t, c, kvroute.WithDecodeMemory(kvroute.DecodeMemory{BufferStreams: []string{kvroute.PathMessages}})))
	ref := []kvroutetest.Option{kvroutetest.WithToolCallRate(1)}
	cut := 0
	for maxTokens := 1; maxTokens <= 40; maxTokens++ {
		client := &toolClient{path: kvroute.PathMessages, stream: true}
		client.next(nil, 0)
		var m map[string]any
		require.NoError(t, json.Unmarshal(client.body(), &m))
		m["max_tokens"] = maxTokens
		streamed, err := json.Marshal(m)
		require.NoError(t, err)
		m["stream"] = false
		plain, err := json.Marshal(m)
		require.NoError(t, err)

		res := send(t, url, kvroute.PathMessages, streamed, nil)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		got := client.read(t, res.raw)
		want, err := kvroutetest.Reference(kvroute.PathMessages, plain, ref...)
		require.NoError(t, err)
		wantStream, err := kvroutetest.Reference(kvroute.PathMessages, streamed, ref...)
		require.NoError(t, err)
		if len(wantStream.ToolCalls) != len(want.ToolCalls) {
			cut++
			assert.Equal(t, "length", want.FinishReason, "max_tokens %d: a cut call", maxTokens)
		}
		assert.Equal(t, want.Text, got.text, "max_tokens %d", maxTokens)
		sameCalls(t, want.ToolCalls, got.calls)
		assert.Equal(t, map[string]string{"length": "max_tokens", "tool_calls": "tool_use", "stop": "end_turn"}[want.FinishReason], got.finish, "max_tokens %d", maxTokens)
	}
	assert.NotZero(t, cut, "some max_tokens cut the call inside it")
}
