package sim_test

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

	"github.com/bidikv/bidikv/internal/sim"
)

// toolAnswer is a reply as a client reads it, in any API.
type toolAnswer struct {
	finish      string // chat finish_reason, Messages stop_reason, Responses status
	content     string
	contentNull bool // chat content null
	calls       []seenCall
}

type seenCall struct{ id, item, name, args string }

// toolBody is a one-turn request of api with one tool ("run", a command
// argument) and the tool choice in that API's shape.
func toolBody(api, choice string, stream bool) map[string]any {
	params := map[string]any{"type": "object", "properties": map[string]any{"command": map[string]any{"type": "string"}}}
	ask := words("please run the tests", 20)
	var b map[string]any
	switch api {
	case sim.PathChat:
		b = map[string]any{"model": "sim-model", "messages": []any{map[string]any{"role": "user", "content": ask}}, "max_tokens": 200,
			"tools": []any{map[string]any{"type": "function", "function": map[string]any{"name": "run", "parameters": params}}}}
	case sim.PathResponses:
		b = map[string]any{"model": "sim-model", "input": ask, "max_output_tokens": 200,
			"tools": []any{map[string]any{"type": "function", "name": "run", "parameters": params}}}
	default:
		b = map[string]any{"model": "sim-model", "messages": []any{map[string]any{"role": "user", "content": ask}}, "max_tokens": 200,
			"tools": []any{map[string]any{"name": "run", "input_schema": params}}}
	}
	if stream {
		b["stream"] = true
	}
	if choice == "" {
		return b
	}
	shapes := map[string]map[string]any{
		sim.PathChat:      {"auto": "auto", "required": "required", "none": "none", "named": map[string]any{"type": "function", "function": map[string]any{"name": "run"}}},
		sim.PathResponses: {"auto": "auto", "required": "required", "none": "none", "named": map[string]any{"type": "function", "name": "run"}},
		sim.PathMessages: {"auto": map[string]any{"type": "auto"}, "required": map[string]any{"type": "any"}, "none": map[string]any{"type": "none"},
			"named": map[string]any{"type": "tool", "name": "run"}},
	}
	b["tool_choice"] = shapes[api][choice]
	return b
}

// askTool sends body to the engine and reads the answer as its client
// does (streamed: from the events alone).
func askTool(t *testing.T, url, api string, body map[string]any) toolAnswer {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	resp, err := http.Post(url+api, "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	if body["stream"] == true {
		return readToolStream(t, api, b)
	}
	return readToolBody(t, api, b)
}

func readToolBody(t *testing.T, api string, b []byte) toolAnswer {
	t.Helper()
	var a toolAnswer
	switch api {
	case sim.PathChat:
		var r struct {
			Choices []struct {
				Message struct {
					Content   *string `json:"content"`
					ToolCalls []struct {
						ID       string `json:"id"`
						Type     string `json:"type"`
						Function struct{ Name, Arguments string }
					} `json:"tool_calls"`
				} `json:"message"`
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal(b, &r), string(b))
		c := r.Choices[0]
		a.finish, a.contentNull = c.FinishReason, c.Message.Content == nil
		if c.Message.Content != nil {
			a.content = *c.Message.Content
		}
		for _, tc := range c.Message.ToolCalls {
			assert.Equal(t, "function", tc.Type)
			a.calls = append(a.calls, seenCall{id: tc.ID, name: tc.Function.Name, args: tc.Function.Arguments})
		}
	case sim.PathResponses:
		var r struct {
			Status string            `json:"status"`
			Output []json.RawMessage `json:"output"`
		}
		require.NoError(t, json.Unmarshal(b, &r), string(b))
		a.finish = r.Status
		for _, raw := range r.Output {
			a.responsesItem(t, raw)
		}
	default:
		var r struct {
			StopReason string `json:"stop_reason"`
			Content    []struct {
				Type  string          `json:"type"`
				Text  string          `json:"text"`
				ID    string          `json:"id"`
				Name  string          `json:"name"`
				Input json.RawMessage `json:"input"`
			} `json:"content"`
		}
		require.NoError(t, json.Unmarshal(b, &r), string(b))
		a.finish = r.StopReason
		for _, c := range r.Content {
			switch c.Type {
			case "text":
				a.content += c.Text
			case "tool_use":
				a.calls = append(a.calls, seenCall{id: c.ID, name: c.Name, args: string(c.Input)})
			}
		}
	}
	return a
}

// responsesItem reads an output item (message text, function call).
func (a *toolAnswer) responsesItem(t *testing.T, raw json.RawMessage) {
	var it struct {
		Type, ID, CallID, Name, Arguments, Status string
		Content                                   []struct{ Text string }
	}
	require.NoError(t, json.Unmarshal(raw, &it))
	var call struct {
		CallID string `json:"call_id"`
	}
	require.NoError(t, json.Unmarshal(raw, &call))
	switch it.Type {
	case "message":
		for _, p := range it.Content {
			a.content += p.Text
		}
	case "function_call":
		assert.Equal(t, "completed", it.Status)
		a.calls = append(a.calls, seenCall{id: call.CallID, item: it.ID, name: it.Name, args: it.Arguments})
	}
}

func readToolStream(t *testing.T, api string, b []byte) toolAnswer {
	t.Helper()
	var a toolAnswer
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 1<<20), 1<<22)
	var call *seenCall
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		switch api {
		case sim.PathChat:
			var ch struct {
				Choices []struct {
					Delta struct {
						Content   *string `json:"content"`
						ToolCalls []struct {
							ID       string `json:"id"`
							Function struct{ Name, Arguments string }
						} `json:"tool_calls"`
					} `json:"delta"`
					FinishReason *string `json:"finish_reason"`
				} `json:"choices"`
			}
			require.NoError(t, json.Unmarshal([]byte(data), &ch), data)
			if len(ch.Choices) == 0 {
				continue
			}
			c := ch.Choices[0]
			if c.Delta.Content != nil {
				a.content += *c.Delta.Content
			}
			for _, tc := range c.Delta.ToolCalls {
				if tc.ID != "" {
					a.calls = append(a.calls, seenCall{id: tc.ID, name: tc.Function.Name})
				}
				require.NotEmpty(t, a.calls, "the first delta of a call carries its id")
				a.calls[len(a.calls)-1].args += tc.Function.Arguments
			}
			if c.FinishReason != nil {
				a.finish = *c.FinishReason
			}
		case sim.PathResponses:
			var ev struct {
				Type     string          `json:"type"`
				Delta    json.RawMessage `json:"delta"`
				Item     json.RawMessage `json:"item"`
				Response struct {
					Status string `json:"status"`
				} `json:"response"`
			}
			require.NoError(t, json.Unmarshal([]byte(data), &ev), data)
			switch ev.Type {
			case "response.output_item.done":
				a.responsesItem(t, ev.Item)
			case "response.completed":
				a.finish = ev.Response.Status
			}
		default:
			var ev struct {
				Type         string `json:"type"`
				ContentBlock *struct {
					Type, ID, Name string
				} `json:"content_block"`
				Delta struct {
					Type        string `json:"type"`
					Text        string `json:"text"`
					PartialJSON string `json:"partial_json"`
					StopReason  string `json:"stop_reason"`
				} `json:"delta"`
			}
			require.NoError(t, json.Unmarshal([]byte(data), &ev), data)
			switch {
			case ev.Type == "content_block_start" && ev.ContentBlock.Type == "tool_use":
				a.calls = append(a.calls, seenCall{id: ev.ContentBlock.ID, name: ev.ContentBlock.Name})
				call = &a.calls[len(a.calls)-1]
			case ev.Delta.Type == "text_delta":
				a.content += ev.Delta.Text
			case ev.Delta.Type == "input_json_delta":
				require.NotNil(t, call, data)
				call.args += ev.Delta.PartialJSON
			case ev.Type == "message_delta":
				a.finish = ev.Delta.StopReason
			}
		}
	}
	require.NoError(t, sc.Err())
	return a
}

// sameArgs reports whether two arguments' JSON texts hold the same object
// (Messages gives the parsed input, the others the text).
func sameArgs(t *testing.T, a, b string) bool {
	t.Helper()
	var x, y any
	require.NoError(t, json.Unmarshal([]byte(a), &x), a)
	require.NoError(t, json.Unmarshal([]byte(b), &y), b)
	return fmt.Sprint(x) == fmt.Sprint(y)
}

// Every API answers each tool_choice as vLLM does, streamed or not: auto
// and required calls finish as chat's tool_calls, Messages' tool_use, a
// Responses function_call item (status completed); a named call finishes
// as a stop (end_turn) though it holds the call; none and an auto reply
// that calls nothing are text. The streamed answer is the whole answer,
// and both are what Parse makes of the reference generation. Ids have
// vLLM's shapes: chat and Messages "chatcmpl-tool-" and 32 hex digits,
// Responses items "fc_" and a uuid with the chat call id, streamed a bare
// uuid with call_id "call_" and a uuid.
func TestToolChoicePerAPI(t *testing.T) {
	always := start(t, sim.NewRegistry(), nil, func(c *sim.Config) { c.ToolCallRate = 1 })
	never := start(t, sim.NewRegistry(), nil, func(c *sim.Config) { c.ToolCallRate = 0 })
	type want struct {
		chat, messages string // finish and stop reasons
		call, text     bool
	}
	cases := []struct {
		choice string
		e      *node
		want   want
	}{
		{"", always, want{"tool_calls", "tool_use", true, true}}, // absent with tools: auto
		{"auto", always, want{"tool_calls", "tool_use", true, true}},
		{"auto", never, want{"stop", "end_turn", false, true}},
		{"required", never, want{"tool_calls", "tool_use", true, false}},
		{"named", always, want{"stop", "end_turn", true, false}},
		{"none", always, want{"stop", "end_turn", false, true}},
	}
	toolID := `^chatcmpl-tool-[0-9a-f]{32}$`
	for _, api := range []string{sim.PathChat, sim.PathResponses, sim.PathMessages} {
		for _, tc := range cases {
			rate := 1.0
			if tc.e == never {
				rate = 0
			}
			for _, stream := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s %q rate %v stream %v", api, tc.choice, rate, stream), func(t *testing.T) {
					body := toolBody(api, tc.choice, stream)
					got := askTool(t, tc.e.url, api, body)
					finish := map[string]string{sim.PathChat: tc.want.chat, sim.PathMessages: tc.want.messages, sim.PathResponses: "completed"}[api]
					assert.Equal(t, finish, got.finish)
					assert.Equal(t, tc.want.text, got.content != "", "text %q", got.content)
					if !tc.want.call {
						assert.Empty(t, got.calls)
						return
					}
					require.Len(t, got.calls, 1)
					c := got.calls[0]
					assert.Equal(t, "run", c.name)
					switch {
					case api == sim.PathResponses && stream:
						assert.Regexp(t, `^call_[0-9a-f]{32}$`, c.id)
						assert.Regexp(t, `^[0-9a-f]{32}$`, c.item)
					case api == sim.PathResponses:
						assert.Regexp(t, toolID, c.id)
						assert.Regexp(t, `^fc_[0-9a-f]{32}$`, c.item)
					default:
						assert.Regexp(t, toolID, c.id)
					}
					if tc.choice == "named" {
						return // the arguments are the model's words
					}
					assert.Regexp(t, `^\{"command": "[a-z]+( [a-z]+)*"\}$`, strings.ReplaceAll(c.args, `":"`, `": "`))

					// the whole answer and the reference say the same
					cfg := sim.DefaultConfig()
					cfg.ToolCallRate = rate
					raw, _ := json.Marshal(body)
					req, err := cfg.ParseRequest(api, raw)
					require.NoError(t, err)
					p := cfg.Parse(sim.Reference("sim-model", tokIDs(req.Prompt), cfg.GenParams(req, 0)), req, stream)
					require.Len(t, p.Calls, 1)
					assert.True(t, sameArgs(t, p.Calls[0].Arguments, c.args), "%s vs %s", p.Calls[0].Arguments, c.args)
					assert.Equal(t, p.Content, got.content)
					if api == sim.PathChat {
						assert.Equal(t, tc.want.chat, p.Finish)
						assert.Equal(t, tc.choice != "required" && !tc.want.text, got.contentNull)
					}
				})
			}
		}
	}
}

// Under auto some replies call a tool and some do not, decided from the
// KV at the rate given (half by default): the same prompt always gets the
// same answer.
func TestAutoToolCallRate(t *testing.T) {
	e := start(t, sim.NewRegistry(), nil, nil)
	calls := 0
	const n = 40
	for i := range n {
		body := toolBody(sim.PathChat, "auto", false)
		body["messages"] = []any{map[string]any{"role": "user", "content": words(fmt.Sprintf("task %d", i), 10)}}
		a := askTool(t, e.url, sim.PathChat, body)
		if len(a.calls) > 0 {
			calls++
			assert.Equal(t, "tool_calls", a.finish)
		} else {
			assert.Equal(t, "stop", a.finish)
		}
		again := askTool(t, e.url, sim.PathChat, body)
		for i := range again.calls {
			again.calls[i].id = a.calls[i].id // drawn per request
		}
		assert.Equal(t, a, again, "the same answer again")
	}
	assert.Greater(t, calls, n/4)
	assert.Less(t, calls, 3*n/4)
}

// A call cut by max_tokens is no call in the whole answer: the parser
// drops the incomplete markup, the reply is its text, the finish length.
// A stream has sent what it had: nothing before the name was whole, then
// the call's id and name and the arguments so far.
func TestToolCallCutByLength(t *testing.T) {
	e := start(t, sim.NewRegistry(), nil, func(c *sim.Config) { c.ToolCallRate = 1 })
	full := askTool(t, e.url, sim.PathChat, toolBody(sim.PathChat, "auto", false))
	require.Len(t, full.calls, 1)
	words := len(strings.Fields(full.content))
	for _, cut := range []int{3, 32} { // into the markup; into the arguments
		for _, stream := range []bool{false, true} {
			body := toolBody(sim.PathChat, "auto", stream)
			body["max_tokens"] = words + cut
			got := askTool(t, e.url, sim.PathChat, body)
			assert.Equal(t, "length", got.finish)
			assert.Equal(t, full.content, got.content)
			if !stream || cut == 3 {
				assert.Empty(t, got.calls)
				continue
			}
			require.Len(t, got.calls, 1)
			assert.Equal(t, "run", got.calls[0].name)
			assert.True(t, strings.HasPrefix(full.calls[0].args, got.calls[0].args), got.calls[0].args)
			assert.Less(t, len(got.calls[0].args), len(full.calls[0].args))
		}
	}
}

// The KV a call leaves is the next turn's prompt: an auto call echoed
// back as each API's client sends it (chat: the message with its
// tool_calls and a tool message; Responses: the message and function_call
// items and a function_call_output; Messages: the text and tool_use blocks
// and a user message with a tool_result block) renders its generated
// tokens exactly, so D's blocks (the prompt and every generated token but
// the last) are a prefix of the next prompt. A required call (vLLM's
// guided JSON list) renders back as the template's markup instead: the
// next prompt leaves the KV right after the first prompt, as with vLLM.
func TestToolCallRendersBack(t *testing.T) {
	cfg := sim.DefaultConfig()
	cfg.ToolCallRate = 1
	e := start(t, sim.NewRegistry(), nil, func(c *sim.Config) { c.ToolCallRate = 1 })
	for _, api := range []string{sim.PathChat, sim.PathResponses, sim.PathMessages} {
		for _, choice := range []string{"auto", "required"} {
			t.Run(api+" "+choice, func(t *testing.T) {
				body := toolBody(api, choice, false)
				raw, _ := json.Marshal(body)
				req, err := cfg.ParseRequest(api, raw)
				require.NoError(t, err)
				prompt := tokIDs(req.Prompt)
				g := sim.Reference("sim-model", prompt, cfg.GenParams(req, 0))
				require.NotNil(t, g.Call)
				held := append(append([]uint32{}, prompt...), tokIDs(g.Tokens[:len(g.Tokens)-1])...)

				got := askTool(t, e.url, api, body)
				require.Len(t, got.calls, 1)
				next := echoToolCall(api, body, got)
				nextIDs := renderIDs(t, cfg, api, next)
				if choice == "required" {
					assert.Equal(t, prompt, nextIDs[:len(prompt)])
					assert.NotEqual(t, held, nextIDs[:len(held)], "the JSON list renders as <tool_call> markup")
					return
				}
				require.Greater(t, len(nextIDs), len(held))
				assert.Equal(t, held, nextIDs[:len(held)])
			})
		}
	}
}

// echoToolCall is the next request after answer a: the assistant's turn
// as its client echoes it, the tool's result, in api's shape.
func echoToolCall(api string, body map[string]any, a toolAnswer) map[string]any {
	next := with(body)
	c := a.calls[0]
	switch api {
	case sim.PathChat:
		msgs := append([]any{}, body["messages"].([]any)...)
		var content any = a.content
		if a.contentNull {
			content = nil
		}
		msgs = append(msgs, map[string]any{"role": "assistant", "content": content, "tool_calls": []any{map[string]any{"id": c.id, "type": "function",
			"function": map[string]any{"name": c.name, "arguments": c.args}}}},
			map[string]any{"role": "tool", "tool_call_id": c.id, "content": "ok: 3 tests passed"})
		next["messages"] = msgs
	case sim.PathResponses:
		items := []any{map[string]any{"type": "message", "role": "user", "content": body["input"]}}
		if a.content != "" {
			items = append(items, map[string]any{"type": "message", "role": "assistant", "status": "completed", "id": "msg_1",
				"content": []any{map[string]any{"type": "output_text", "text": a.content, "annotations": []any{}}}})
		}
		items = append(items, map[string]any{"type": "function_call", "id": c.item, "call_id": c.id, "name": c.name, "arguments": c.args, "status": "completed"},
			map[string]any{"type": "function_call_output", "call_id": c.id, "output": "ok: 3 tests passed"})
		next["input"] = items
	default:
		var blocks []any
		if a.content != "" {
			blocks = append(blocks, map[string]any{"type": "text", "text": a.content})
		}
		blocks = append(blocks, map[string]any{"type": "tool_use", "id": c.id, "name": c.name, "input": json.RawMessage(c.args)})
		msgs := append([]any{}, body["messages"].([]any)...)
		msgs = append(msgs, map[string]any{"role": "assistant", "content": blocks},
			map[string]any{"role": "user", "content": []any{map[string]any{"type": "tool_result", "tool_use_id": c.id, "content": "ok: 3 tests passed"}}})
		next["messages"] = msgs
	}
	delete(next, "tool_choice")
	return next
}
