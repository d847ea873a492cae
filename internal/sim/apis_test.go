package sim_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// conv is one conversation, written in each API's format.
type conv struct {
	system string
	turns  []string // user, assistant, user, ...
}

func (c conv) chat() map[string]any {
	var msgs []map[string]any
	if c.system != "" {
		msgs = append(msgs, map[string]any{"role": "system", "content": c.system})
	}
	for i, t := range c.turns {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, map[string]any{"role": role, "content": t})
	}
	return map[string]any{"model": "sim-model", "messages": msgs}
}

func (c conv) responses() map[string]any {
	var items []map[string]any
	for i, t := range c.turns {
		if i%2 == 1 {
			items = append(items, map[string]any{"type": "message", "role": "assistant", "status": "completed", "id": "msg_x",
				"content": []map[string]any{{"type": "output_text", "text": t, "annotations": []any{}}}})
			continue
		}
		items = append(items, map[string]any{"type": "message", "role": "user",
			"content": []map[string]any{{"type": "input_text", "text": t}}})
	}
	body := map[string]any{"model": "sim-model", "input": items}
	if c.system != "" {
		body["instructions"] = c.system
	}
	return body
}

func (c conv) messages() map[string]any {
	var msgs []map[string]any
	for i, t := range c.turns {
		if i%2 == 1 {
			msgs = append(msgs, map[string]any{"role": "assistant", "content": []map[string]any{{"type": "text", "text": t}}})
			continue
		}
		msgs = append(msgs, map[string]any{"role": "user", "content": t})
	}
	body := map[string]any{"model": "sim-model", "max_tokens": 64, "messages": msgs}
	if c.system != "" {
		body["system"] = []map[string]any{{"type": "text", "text": c.system, "cache_control": map[string]any{"type": "ephemeral"}}}
	}
	return body
}

func renderIDs(t *testing.T, cfg sim.Config, path string, body any) []uint32 {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := cfg.ParseRequest(path, raw)
	require.NoError(t, err, string(raw))
	out := make([]uint32, len(req.Prompt))
	for i, tk := range req.Prompt {
		out[i] = tk.ID
	}
	return out
}

// The same conversation sent as chat, responses and messages renders to the
// same prompt tokens.
func TestAPIsRenderLikeChat(t *testing.T) {
	c := conv{system: "be brief", turns: []string{"hello there", "hi, what do you need", "the weather"}}
	tool := map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}}
	tests := []struct {
		name                     string
		chat, responses, message map[string]any
	}{
		{"plain", c.chat(), c.responses(), c.messages()},
		{"no system, string input", conv{turns: []string{"just this"}}.chat(),
			map[string]any{"input": "just this"}, conv{turns: []string{"just this"}}.messages()},
		{"tools",
			with(c.chat(), "tools", []any{map[string]any{"type": "function", "function": map[string]any{"name": "weather", "description": "look it up", "parameters": tool}}}),
			with(c.responses(), "tools", []any{map[string]any{"type": "function", "name": "weather", "description": "look it up", "parameters": tool, "strict": true}}),
			with(c.messages(), "tools", []any{map[string]any{"name": "weather", "description": "look it up", "input_schema": map[string]any{"properties": tool["properties"]}}}),
		},
		{"reasoning effort", with(c.chat(), "reasoning_effort", "low"),
			with(c.responses(), "reasoning", map[string]any{"effort": "low", "summary": "auto"}),
			with(c.messages(), "output_config", map[string]any{"effort": "low"})},
		{"tool call round",
			map[string]any{"messages": []any{
				map[string]any{"role": "user", "content": "weather in Paris"},
				map[string]any{"role": "assistant", "content": nil, "tool_calls": []any{map[string]any{"id": "c1", "type": "function",
					"function": map[string]any{"name": "weather", "arguments": `{"city": "Paris"}`}}}},
				map[string]any{"role": "tool", "tool_call_id": "c1", "content": "sunny"},
			}},
			map[string]any{"input": []any{
				map[string]any{"role": "user", "content": "weather in Paris"},
				map[string]any{"type": "function_call", "call_id": "c1", "name": "weather", "arguments": `{"city":"Paris"}`},
				map[string]any{"type": "function_call_output", "call_id": "c1", "output": "sunny"},
			}},
			map[string]any{"model": "sim-model", "max_tokens": 5, "messages": []any{
				map[string]any{"role": "user", "content": "weather in Paris"},
				map[string]any{"role": "assistant", "content": []any{map[string]any{"type": "tool_use", "id": "c1", "name": "weather", "input": map[string]any{"city": "Paris"}}}},
				map[string]any{"role": "user", "content": []any{map[string]any{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}}},
			}},
		},
		{"past reasoning dropped", conv{turns: []string{"q", "the answer", "more"}}.chat(),
			map[string]any{"input": []any{
				map[string]any{"role": "user", "content": "q"},
				map[string]any{"type": "reasoning", "id": "rs_1", "summary": []any{}, "content": []any{map[string]any{"type": "reasoning_text", "text": "hmm"}}},
				map[string]any{"type": "message", "role": "assistant", "content": []any{map[string]any{"type": "output_text", "text": "the answer"}}},
				map[string]any{"role": "user", "content": "more"},
			}},
			map[string]any{"model": "sim-model", "max_tokens": 5, "messages": []any{
				map[string]any{"role": "user", "content": "q"},
				map[string]any{"role": "assistant", "content": []any{map[string]any{"type": "thinking", "thinking": "hmm", "signature": "s"},
					map[string]any{"type": "text", "text": "the answer"}}},
				map[string]any{"role": "user", "content": "more"},
			}},
		},
	}
	for _, tmpl := range []string{sim.TemplateChatML, sim.TemplateLlama3} {
		cfg := sim.DefaultConfig()
		cfg.Template, cfg.Reasoning = tmpl, true
		for _, tt := range tests {
			t.Run(tmpl+"/"+tt.name, func(t *testing.T) {
				want := renderIDs(t, cfg, sim.PathChat, tt.chat)
				assert.Equal(t, want, renderIDs(t, cfg, sim.PathResponses, tt.responses), "responses")
				assert.Equal(t, want, renderIDs(t, cfg, sim.PathMessages, tt.message), "messages")
				assert.Equal(t, want, renderIDs(t, cfg, sim.PathCountTokens, tt.message), "count_tokens")
			})
		}
	}
}

// A final assistant item left in_progress or incomplete is continued, as
// chat's continue_final_message.
func TestResponsesContinueFinalMessage(t *testing.T) {
	cfg := sim.DefaultConfig()
	want := renderIDs(t, cfg, sim.PathChat, map[string]any{"messages": []any{
		map[string]any{"role": "user", "content": "count to ten"},
		map[string]any{"role": "assistant", "content": "one two"},
	}, "continue_final_message": true, "add_generation_prompt": false})
	got := renderIDs(t, cfg, sim.PathResponses, map[string]any{"input": []any{
		map[string]any{"role": "user", "content": "count to ten"},
		map[string]any{"type": "message", "role": "assistant", "status": "incomplete",
			"content": []any{map[string]any{"type": "output_text", "text": "one two"}}},
	}})
	assert.Equal(t, want, got)
}

type sseEvent struct {
	name string
	data map[string]any
	raw  string
}

func readEvents(t *testing.T, b []byte) []sseEvent {
	t.Helper()
	var out []sseEvent
	for _, block := range strings.Split(strings.TrimSpace(string(b)), "\n\n") {
		var ev sseEvent
		for _, line := range strings.Split(block, "\n") {
			switch {
			case strings.HasPrefix(line, "event: "):
				ev.name = strings.TrimPrefix(line, "event: ")
			case strings.HasPrefix(line, "data: "):
				ev.raw = strings.TrimPrefix(line, "data: ")
				require.NoError(t, json.Unmarshal([]byte(ev.raw), &ev.data), ev.raw)
			}
		}
		out = append(out, ev)
	}
	return out
}

func names(evs []sseEvent) []string {
	out := make([]string, len(evs))
	for i, ev := range evs {
		out[i] = ev.name
	}
	return out
}

// apiResult is the text and handle of a Responses or Messages reply.
type apiResult struct {
	text, reasoning string
	kv              json.RawMessage
	events          []sseEvent
	body            map[string]any
}

func postAPI(t *testing.T, url, path string, body map[string]any) apiResult {
	t.Helper()
	r := postAPIRaw(t, url, path, body)
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	var res apiResult
	stream := bytes.HasPrefix(r.Body, []byte("event:"))
	if !stream {
		require.NoError(t, json.Unmarshal(r.Body, &res.body))
		var kv struct {
			KV json.RawMessage `json:"kv_transfer_params"`
		}
		require.NoError(t, json.Unmarshal(r.Body, &kv))
		if len(kv.KV) > 0 && string(kv.KV) != "null" {
			res.kv = kv.KV
		}
	}
	switch {
	case path == sim.PathResponses && !stream:
		for _, it := range res.body["output"].([]any) {
			item := it.(map[string]any)
			switch item["type"] {
			case "message":
				for _, c := range item["content"].([]any) {
					res.text += c.(map[string]any)["text"].(string)
				}
			case "reasoning":
				res.reasoning += item["content"].([]any)[0].(map[string]any)["text"].(string)
			}
		}
	case path == sim.PathResponses:
		res.events = readEvents(t, r.Body)
		for _, ev := range res.events {
			switch ev.name {
			case "response.output_text.delta":
				res.text += ev.data["delta"].(string)
			case "response.reasoning_text.delta":
				res.reasoning += ev.data["delta"].(string)
			}
			if resp, ok := ev.data["response"].(map[string]any); ok && resp["kv_transfer_params"] != nil {
				require.Equal(t, "response.completed", ev.name, "only response.completed carries the handle")
				res.kv, _ = json.Marshal(resp["kv_transfer_params"])
			}
		}
	case !stream:
		for _, c := range res.body["content"].([]any) {
			block := c.(map[string]any)
			switch block["type"] {
			case "text":
				res.text += block["text"].(string)
			case "thinking":
				res.reasoning += block["thinking"].(string)
			}
		}
	default:
		res.events = readEvents(t, r.Body)
		for _, ev := range res.events {
			assert.NotContains(t, ev.raw, "kv_transfer_params", "no handle in a Messages stream")
			if d, ok := ev.data["delta"].(map[string]any); ok {
				if s, ok := d["text"].(string); ok {
					res.text += s
				}
				if s, ok := d["thinking"].(string); ok {
					res.reasoning += s
				}
			}
		}
	}
	return res
}

// postAPIRaw posts body and returns the raw answer.
func postAPIRaw(t *testing.T, url, path string, body any) result {
	t.Helper()
	status, b := postRaw(t, url, path, body)
	return result{Status: status, Body: b}
}

func assistantTurn(path, text string) map[string]any {
	if path == sim.PathResponses {
		return map[string]any{"type": "message", "role": "assistant", "content": []any{map[string]any{"type": "output_text", "text": text}}}
	}
	return map[string]any{"role": "assistant", "content": text}
}

func userTurn(path, text string) map[string]any {
	if path == sim.PathResponses {
		return map[string]any{"role": "user", "content": []any{map[string]any{"type": "input_text", "text": text}}}
	}
	return map[string]any{"role": "user", "content": text}
}

func apiBody(path string, turns []map[string]any) map[string]any {
	if path == sim.PathResponses {
		return map[string]any{"model": "sim-model", "input": turns, "instructions": "be brief"}
	}
	return map[string]any{"model": "sim-model", "max_tokens": 200, "system": "be brief", "messages": turns}
}

// A hand-driven P→D→P round trip over each API, body and stream: D gives
// the reference answer and the next P pulls the history from D.
func TestAPIsDisaggregatedRoundTrip(t *testing.T) {
	for _, path := range []string{sim.PathResponses, sim.PathMessages} {
		for _, stream := range []bool{false, true} {
			name := path + map[bool]string{false: "/body", true: "/stream"}[stream]
			t.Run(name, func(t *testing.T) {
				reg, clk := sim.NewRegistry(), newClock()
				// P without prefix caching, so that it pulls all it lacks
				p := start(t, reg, clk, func(c *sim.Config) { c.StreamHandles, c.PrefixCaching = true, false })
				d := start(t, reg, clk, func(c *sim.Config) { c.StreamHandles = true })
				maxKey := "max_tokens"
				if path == sim.PathResponses {
					maxKey = "max_output_tokens"
				}
				turns := []map[string]any{userTurn(path, words("first", 100))}
				body := apiBody(path, turns)
				rp := postAPI(t, p.url, path, with(body, maxKey, 1, "stream", false, "kv_transfer_params", missHandle()))
				require.NotNil(t, rp.kv, "P's handle")
				assert.Equal(t, true, decodeHandle(t, rp.kv)["do_remote_prefill"])
				if path == sim.PathResponses {
					assert.Equal(t, "incomplete", rp.body["status"], "P stops on max_output_tokens")
				} else {
					assert.Equal(t, "max_tokens", rp.body["stop_reason"])
				}

				rd := postAPI(t, d.url, path, with(body, "stream", stream, "kv_transfer_params", rp.kv))
				ref := reference(t, path, body)
				assert.Equal(t, ref.Content, rd.text)
				assert.Zero(t, d.Stats().WrongOutputs)
				assert.Equal(t, p.Records()[0].PromptTokens, d.Stats().TokensPulledIn, "D pulled P's prompt")
				if path == sim.PathMessages && stream {
					assert.Nil(t, rd.kv, "stock Messages streams carry no handle")
					return
				}
				require.NotNil(t, rd.kv, "D's handle")
				assert.Equal(t, true, decodeHandle(t, rd.kv)["do_remote_decode"])

				turns = append(turns, assistantTurn(path, rd.text), userTurn(path, words("second", 100)))
				body2 := apiBody(path, turns)
				rp2 := postAPI(t, p.url, path, with(body2, maxKey, 1, "kv_transfer_params", asP(t, rd.kv)))
				require.NotNil(t, rp2.kv)
				rec := p.Records()[1]
				assert.Equal(t, sim.PullRead, rec.Pull, "P pulls the history from D")
				assert.Equal(t, d.Records()[0].PromptTokens+d.Records()[0].CompletionTokens-1, rec.PulledTokens)
				assert.False(t, rec.Poisoned)
				rd2 := postAPI(t, d.url, path, with(body2, "stream", stream, "kv_transfer_params", rp2.kv))
				assert.Equal(t, reference(t, path, body2).Content, rd2.text)
				assert.Zero(t, p.Stats().WrongOutputs+d.Stats().WrongOutputs)
			})
		}
	}
}

func TestResponsesShapes(t *testing.T) {
	for _, reasoning := range []bool{false, true} {
		t.Run(map[bool]string{false: "plain", true: "reasoning"}[reasoning], func(t *testing.T) {
			e := start(t, nil, nil, func(c *sim.Config) { c.Reasoning = reasoning })
			body := map[string]any{"model": "sim-model", "input": "hello there", "metadata": map[string]any{"k": "v"}}
			r := postAPI(t, e.url, sim.PathResponses, body)
			b := r.body
			assert.True(t, strings.HasPrefix(b["id"].(string), "resp_"))
			assert.Equal(t, "response", b["object"])
			assert.Equal(t, "completed", b["status"])
			assert.Equal(t, map[string]any{"k": "v"}, b["metadata"])
			assert.Contains(t, b, "kv_transfer_params")
			assert.Nil(t, b["kv_transfer_params"])
			out := b["output"].([]any)
			last := out[len(out)-1].(map[string]any)
			assert.Equal(t, "message", last["type"])
			assert.Equal(t, "assistant", last["role"])
			assert.Equal(t, "completed", last["status"])
			assert.True(t, strings.HasPrefix(last["id"].(string), "msg_"))
			part := last["content"].([]any)[0].(map[string]any)
			assert.Equal(t, "output_text", part["type"])
			assert.Equal(t, []any{}, part["annotations"])
			u := b["usage"].(map[string]any)
			assert.EqualValues(t, u["input_tokens"].(float64)+u["output_tokens"].(float64), u["total_tokens"])
			assert.Contains(t, u["input_tokens_details"], "cached_tokens")
			if reasoning {
				require.Len(t, out, 2)
				assert.Equal(t, "reasoning", out[0].(map[string]any)["type"])
				assert.NotEmpty(t, r.reasoning)
				assert.Positive(t, u["output_tokens_details"].(map[string]any)["reasoning_tokens"])
			} else {
				require.Len(t, out, 1)
			}

			s := postAPI(t, e.url, sim.PathResponses, with(body, "stream", true))
			assert.Equal(t, r.text, s.text)
			assert.Equal(t, r.reasoning, s.reasoning)
			want := []string{"response.created", "response.in_progress"}
			if reasoning {
				want = append(want, "response.output_item.added", "response.content_part.added")
				for range strings.Count(strings.Join(names(s.events), " "), "response.reasoning_text.delta") {
					want = append(want, "response.reasoning_text.delta")
				}
				want = append(want, "response.reasoning_text.done", "response.content_part.done", "response.output_item.done")
			}
			want = append(want, "response.output_item.added", "response.content_part.added")
			for range strings.Count(strings.Join(names(s.events), " "), "response.output_text.delta") {
				want = append(want, "response.output_text.delta")
			}
			want = append(want, "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed")
			assert.Equal(t, want, names(s.events))
			for i, ev := range s.events {
				assert.Equal(t, ev.name, ev.data["type"])
				assert.EqualValues(t, i, ev.data["sequence_number"])
			}
			assert.Equal(t, "in_progress", s.events[0].data["response"].(map[string]any)["status"])
			final := s.events[len(s.events)-1].data["response"].(map[string]any)
			assert.Equal(t, "completed", final["status"])
			assert.Equal(t, s.events[0].data["response"].(map[string]any)["id"], final["id"])
		})
	}
}

// TestResponsesStreamHandle: response.completed wraps the final object, so
// it carries D's handle on stock engines too (PR #37424), without
// StreamHandles (#40186, chat and completions streams only); an engine
// older than #37424 has none anywhere. The stream's item ids are the ones
// the client saw announced, though the engine rebuilds its events when the
// handle arrives (the OpenAI SDK's stream helper checks each event's
// item_id against the item at its output_index).
func TestResponsesStreamHandle(t *testing.T) {
	for _, c := range []struct {
		name                 string
		streamHandles, noAPI bool
	}{{"stock", false, false}, {"pr40186", true, false}, {"before37424", false, true}} {
		t.Run(c.name, func(t *testing.T) {
			reg := sim.NewRegistry()
			p := start(t, reg, nil, nil)
			d := start(t, reg, nil, func(cfg *sim.Config) { cfg.StreamHandles, cfg.NoResponsesKV = c.streamHandles, c.noAPI })
			body := map[string]any{"input": words("x", 80)}
			rp := postAPI(t, p.url, sim.PathResponses, with(body, "max_output_tokens", 1, "kv_transfer_params", missHandle()))
			rd := postAPI(t, d.url, sim.PathResponses, with(body, "stream", true, "kv_transfer_params", rp.kv))
			if c.noAPI {
				assert.Nil(t, rd.kv, "an engine before #37424 returns no handle")
			} else {
				assert.NotNil(t, rd.kv, "response.completed carries D's handle")
			}
			for _, ev := range rd.events[:2] {
				r := ev.data["response"].(map[string]any)
				assert.Nil(t, r["kv_transfer_params"], "created and in_progress carry none")
			}
			items := map[float64]string{} // output_index -> announced id
			for _, ev := range rd.events {
				idx, _ := ev.data["output_index"].(float64)
				if item, ok := ev.data["item"].(map[string]any); ok {
					if ev.name == "response.output_item.added" {
						items[idx] = item["id"].(string)
					}
					assert.Equal(t, items[idx], item["id"], ev.name)
				}
				if id, ok := ev.data["item_id"]; ok {
					assert.Equal(t, items[idx], id, ev.name)
				}
			}
			assert.NotEmpty(t, items)
		})
	}
}

func TestMessagesShapes(t *testing.T) {
	e := start(t, nil, nil, func(c *sim.Config) { c.Reasoning = true })
	body := map[string]any{"model": "sim-model", "max_tokens": 100, "messages": []any{map[string]any{"role": "user", "content": "hello"}}}
	r := postAPI(t, e.url, sim.PathMessages+"?beta=true", body)
	b := r.body
	assert.True(t, strings.HasPrefix(b["id"].(string), "chatcmpl-"), "vLLM keeps the chat completion's id")
	assert.Equal(t, "message", b["type"])
	assert.Equal(t, "assistant", b["role"])
	assert.Equal(t, "end_turn", b["stop_reason"])
	assert.NotContains(t, b, "stop_sequence", "exclude_none drops it")
	assert.NotContains(t, b, "kv_transfer_params", "exclude_none drops a null handle")
	content := b["content"].([]any)
	require.Len(t, content, 2)
	assert.Equal(t, "thinking", content[0].(map[string]any)["type"])
	assert.NotEmpty(t, content[0].(map[string]any)["signature"])
	assert.Equal(t, "text", content[1].(map[string]any)["type"])
	u := b["usage"].(map[string]any)
	assert.Positive(t, u["input_tokens"])
	assert.Positive(t, u["output_tokens"])

	s := postAPI(t, e.url, sim.PathMessages, with(body, "stream", true))
	assert.Equal(t, r.text, s.text)
	assert.Equal(t, r.reasoning, s.reasoning)
	ns := names(s.events)
	var want []string
	want = append(want, "message_start", "content_block_start")
	for range strings.Count(s.raw(), `"thinking_delta"`) {
		want = append(want, "content_block_delta")
	}
	want = append(want, "content_block_delta", "content_block_stop", "content_block_start") // signature, then text
	for range strings.Count(s.raw(), `"text_delta"`) {
		want = append(want, "content_block_delta")
	}
	want = append(want, "content_block_stop", "message_delta", "message_stop")
	assert.Equal(t, want, ns)
	for _, ev := range s.events {
		assert.Equal(t, ev.name, ev.data["type"])
	}
	start := s.events[0].data["message"].(map[string]any)
	assert.NotContains(t, start, "type", "exclude_unset")
	assert.Equal(t, map[string]any{"input_tokens": u["input_tokens"], "output_tokens": 0.0}, start["usage"])
	md := s.events[len(s.events)-2].data
	assert.Equal(t, map[string]any{"stop_reason": "end_turn"}, md["delta"])
	assert.Equal(t, u, md["usage"])

	// P's leg: max_tokens 1 is valid
	one := postAPI(t, e.url, sim.PathMessages, with(body, "max_tokens", 1))
	assert.Equal(t, "max_tokens", one.body["stop_reason"])
}

func (r apiResult) raw() string {
	var sb strings.Builder
	for _, ev := range r.events {
		sb.WriteString(ev.raw)
	}
	return sb.String()
}

func TestAPIsErrorsAndRoutes(t *testing.T) {
	e := start(t, nil, nil, nil)
	anthropic := func(r result, status int, typ string) {
		t.Helper()
		require.Equal(t, status, r.Status, string(r.Body))
		var b struct {
			Type  string `json:"type"`
			Error struct {
				Type, Message string
			} `json:"error"`
		}
		require.NoError(t, json.Unmarshal(r.Body, &b))
		assert.Equal(t, "error", b.Type)
		assert.Equal(t, typ, b.Error.Type)
		assert.NotEmpty(t, b.Error.Message)
	}
	msgs := []any{map[string]any{"role": "user", "content": "hi"}}
	anthropic(postAPIRaw(t, e.url, sim.PathMessages, map[string]any{"model": "sim-model", "messages": msgs}), 400, "BadRequestError")
	anthropic(postAPIRaw(t, e.url, sim.PathMessages, map[string]any{"model": "sim-model", "max_tokens": 0, "messages": msgs}), 400, "BadRequestError")
	anthropic(postAPIRaw(t, e.url, sim.PathMessages, map[string]any{"model": "other", "max_tokens": 3, "messages": msgs}), 404, "NotFoundError")
	anthropic(postAPIRaw(t, e.url, sim.PathMessages, map[string]any{"model": "sim-model", "max_tokens": 3, "messages": []any{}}), 400, "BadRequestError")

	e.FailNext(1, http.StatusServiceUnavailable)
	anthropic(postAPIRaw(t, e.url, sim.PathMessages, map[string]any{"model": "sim-model", "max_tokens": 3, "messages": msgs}), 503, "ServiceUnavailableError")
	assert.Equal(t, http.StatusBadRequest, postAPIRaw(t, e.url, sim.PathResponses, map[string]any{"input": "hi", "background": true}).Status)

	r := postAPIRaw(t, e.url, sim.PathResponses, map[string]any{"input": "hi", "previous_response_id": "resp_123"})
	require.Equal(t, http.StatusNotFound, r.Status)
	assert.Contains(t, string(r.Body), "Response with id 'resp_123' not found.")
	assert.Contains(t, string(r.Body), `"error":`)
	r = postAPIRaw(t, e.url, sim.PathResponses, map[string]any{"input": "hi", "store": true})
	assert.Equal(t, http.StatusOK, r.Status, "store is ignored without a response store")

	ct := postAPIRaw(t, e.url, sim.PathCountTokens, map[string]any{"model": "sim-model", "messages": msgs})
	require.Equal(t, http.StatusOK, ct.Status, string(ct.Body))
	var n struct {
		InputTokens int `json:"input_tokens"`
	}
	require.NoError(t, json.Unmarshal(ct.Body, &n))
	assert.Equal(t, len(renderIDs(t, sim.DefaultConfig(), sim.PathChat, map[string]any{"messages": msgs})), n.InputTokens)

	// render: the same tokens as generation, one GenerateRequest
	body := map[string]any{"input": "hi", "request_id": "resp_abc", "max_output_tokens": 7}
	rr := postAPIRaw(t, e.url, sim.PathResponsesRender, body)
	require.Equal(t, http.StatusOK, rr.Status, string(rr.Body))
	var gr struct {
		RequestID      string         `json:"request_id"`
		TokenIDs       []uint32       `json:"token_ids"`
		SamplingParams map[string]any `json:"sampling_params"`
	}
	require.NoError(t, json.Unmarshal(rr.Body, &gr))
	assert.Equal(t, "resp_abc", gr.RequestID)
	assert.Equal(t, renderIDs(t, sim.DefaultConfig(), sim.PathResponses, body), gr.TokenIDs)
	assert.EqualValues(t, 7, gr.SamplingParams["max_tokens"])
	mr := postAPIRaw(t, e.url, sim.PathMessagesRender, map[string]any{"model": "sim-model", "max_tokens": 3, "messages": msgs})
	require.Equal(t, http.StatusOK, mr.Status, string(mr.Body))

	off := start(t, nil, nil, func(c *sim.Config) { c.Render = sim.RenderDisabled })
	r = postAPIRaw(t, off.url, sim.PathResponsesRender, body)
	assert.Equal(t, http.StatusNotImplemented, r.Status)
	assert.Contains(t, string(r.Body), "The model does not support Responses Render API")
	absent := start(t, nil, nil, func(c *sim.Config) { c.Render = sim.RenderAbsent })
	assert.Equal(t, http.StatusNotFound, postAPIRaw(t, absent.url, sim.PathMessagesRender, body).Status)

	resp, err := http.Get(e.url + sim.PathMessages)
	require.NoError(t, err)
	_, _ = io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusMethodNotAllowed, resp.StatusCode)

	st := e.Stats()
	assert.Equal(t, 1, st.TokenizeRequests, "count_tokens")
	assert.Equal(t, 2, st.RenderRequests)
}

// A cut Responses or Messages stream aborts D's request: its blocks are
// freed and no handle survives, as for chat.
func TestAPIsStreamCut(t *testing.T) {
	for _, path := range []string{sim.PathResponses, sim.PathMessages} {
		t.Run(path, func(t *testing.T) {
			reg := sim.NewRegistry()
			p := start(t, reg, nil, nil)
			d := start(t, reg, nil, func(c *sim.Config) { c.StreamHandles = true })
			maxKey := "max_tokens"
			if path == sim.PathResponses {
				maxKey = "max_output_tokens"
			}
			body := apiBody(path, []map[string]any{userTurn(path, words("cut", 90))})
			rp := postAPI(t, p.url, path, with(body, maxKey, 1, "kv_transfer_params", missHandle()))
			d.CutStreamAfter(4)
			raw, _ := json.Marshal(with(body, "stream", true, "kv_transfer_params", rp.kv))
			resp, err := http.Post(d.url+path, "application/json", bytes.NewReader(raw))
			if err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			st := d.Stats()
			assert.Equal(t, 1, st.Aborted)
			assert.Zero(t, st.BlocksPinned, "an aborted request holds nothing")
			assert.Nil(t, d.Records()[0].Handle)
		})
	}
}

// A stream over any API sleeps the same modelled decode steps as the chat
// stream of the same conversation.
func TestAPIsStreamTiming(t *testing.T) {
	c := conv{system: "be brief", turns: []string{"tell me a story about the sea"}}
	bodies := map[string]map[string]any{
		sim.PathChat:      with(c.chat(), "stream", true),
		sim.PathResponses: with(c.responses(), "stream", true),
		sim.PathMessages:  with(c.messages(), "stream", true),
	}
	var want time.Duration
	for _, path := range []string{sim.PathChat, sim.PathResponses, sim.PathMessages} {
		clk := &sleepClock{vclock: vclock{now: time.Unix(1_700_000_000, 0)}}
		e := start(t, nil, clk, func(c *sim.Config) {
			c.Reasoning = true
			c.Profile = sim.Profile{InterTokenLatency: time.Millisecond, PrefillPerToken: time.Microsecond}
		})
		r := postAPIRaw(t, e.url, path, bodies[path])
		require.Equal(t, http.StatusOK, r.Status, string(r.Body))
		var total time.Duration
		for _, d := range clk.durations() {
			total += d
		}
		if path == sim.PathChat {
			want = total
			require.Positive(t, want)
			continue
		}
		assert.Equal(t, want, total, path)
	}
}

// TestStreamHandleCoversItsTokens: a reasoning reply's <think> and </think>
// tokens render no chunk but are still decoded, so D's handle (streamed or
// not) names enough blocks for its remote_num_tokens at every prompt length
// (a block boundary falling on a skipped token once gave 16 blocks for 258
// tokens, a handle vLLM cannot read).
func TestStreamHandleCoversItsTokens(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, func(c *sim.Config) { c.Reasoning = true })
	d := start(t, reg, nil, func(c *sim.Config) { c.Reasoning = true })
	bs := d.Engine.Config().BlockSize
	for n := 40; n < 40+2*bs; n++ {
		for _, stream := range []bool{false, true} {
			body := map[string]any{"input": words(fmt.Sprintf("w%d", n), n), "max_output_tokens": 20}
			rp := postAPI(t, p.url, sim.PathResponses, with(body, "max_output_tokens", 1, "kv_transfer_params", missHandle()))
			rd := postAPI(t, d.url, sim.PathResponses, with(body, "stream", stream, "kv_transfer_params", rp.kv))
			require.NotNil(t, rd.kv, "n=%d stream=%v", n, stream)
			h := decodeHandle(t, rd.kv)
			blocks := h["remote_block_ids"].([]any)[0].([]any)
			num := int(h["remote_num_tokens"].(float64))
			assert.GreaterOrEqual(t, len(blocks)*bs, num, "n=%d stream=%v: %d blocks for %d tokens", n, stream, len(blocks), num)
		}
	}
}
