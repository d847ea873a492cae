package sim_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

var simTools = []any{map[string]any{"type": "function", "function": map[string]any{"name": "run",
	"description": "run a command", "parameters": map[string]any{"type": "object"}}}}

// A named tool_choice makes the reply that tool's call, as vLLM answers
// it: content "", one tool call (id chatcmpl-tool-…, type function, the
// name, the generated text as arguments), finish_reason the
// generation's; streamed, the first delta carries the id and name and
// every delta a piece of the arguments. The next turn renders the call
// and the tool's result.
func TestNamedToolChoice(t *testing.T) {
	e := start(t, sim.NewRegistry(), nil, nil)
	body := with(chat(msg{"user", words("tool", 30)}), "tools", simTools, "max_tokens", 12,
		"tool_choice", map[string]any{"type": "function", "function": map[string]any{"name": "run"}})
	ref := reference(t, sim.PathChat, body)

	r := post(t, e.url, sim.PathChat, body)
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	var ans struct {
		Choices []struct {
			Message struct {
				Content   *string `json:"content"`
				ToolCalls []struct {
					ID       string `json:"id"`
					Type     string `json:"type"`
					Function struct {
						Name      string `json:"name"`
						Arguments string `json:"arguments"`
					} `json:"function"`
				} `json:"tool_calls"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(r.Body, &ans))
	m := ans.Choices[0].Message
	require.NotNil(t, m.Content)
	assert.Empty(t, *m.Content)
	require.Len(t, m.ToolCalls, 1)
	call := m.ToolCalls[0]
	assert.Regexp(t, `^chatcmpl-tool-[0-9a-f]{32}$`, call.ID)
	assert.Equal(t, "function", call.Type)
	assert.Equal(t, "run", call.Function.Name)
	assert.Equal(t, ref.Content, call.Function.Arguments)
	assert.Equal(t, ref.Finish, ans.Choices[0].FinishReason, "a named call keeps the generation's finish_reason")

	s, _ := stream(t, e.url, with(body, "stream", true))
	var args strings.Builder
	var first struct{ id, name string }
	for _, ev := range s.events {
		var ch struct {
			Choices []struct {
				Delta struct {
					Content   *string `json:"content"`
					ToolCalls []struct {
						Index    int    `json:"index"`
						ID       string `json:"id"`
						Function struct {
							Name      string `json:"name"`
							Arguments string `json:"arguments"`
						} `json:"function"`
					} `json:"tool_calls"`
				} `json:"delta"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal([]byte(ev), &ch), ev)
		if len(ch.Choices) == 0 {
			continue
		}
		d := ch.Choices[0].Delta
		if d.Content != nil {
			assert.Empty(t, *d.Content, "no text beside the call")
		}
		for _, tc := range d.ToolCalls {
			if first.id == "" {
				first.id, first.name = tc.ID, tc.Function.Name
			} else {
				assert.Empty(t, tc.ID, "only the first delta carries the id")
			}
			args.WriteString(tc.Function.Arguments)
		}
	}
	assert.Regexp(t, `^chatcmpl-tool-[0-9a-f]{32}$`, first.id)
	assert.Equal(t, "run", first.name)
	assert.Equal(t, ref.Content, args.String())

	// The client sends the call back with the tool's result.
	next := with(body, "messages", []any{msg{"user", words("tool", 30)},
		map[string]any{"role": "assistant", "content": "", "tool_calls": []any{map[string]any{"id": call.ID, "type": "function",
			"function": map[string]any{"name": "run", "arguments": call.Function.Arguments}}}},
		map[string]any{"role": "tool", "tool_call_id": call.ID, "content": "ok"}}, "tool_choice", "auto")
	r = post(t, e.url, sim.PathChat, next)
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	assert.NotEmpty(t, r.Text)
}

// A named tool_choice is checked as vLLM's request validation checks it.
func TestNamedToolChoiceErrors(t *testing.T) {
	e := start(t, sim.NewRegistry(), nil, nil)
	named := map[string]any{"type": "function", "function": map[string]any{"name": "run"}}
	for name, body := range map[string]map[string]any{
		"no tools":         with(chat(msg{"user", "hi"}), "tool_choice", named),
		"unknown tool":     with(chat(msg{"user", "hi"}), "tool_choice", map[string]any{"type": "function", "function": map[string]any{"name": "other"}}, "tools", simTools),
		"tools not a list": with(chat(msg{"user", "hi"}), "tool_choice", named, "tools", "run"),
	} {
		t.Run(name, func(t *testing.T) {
			r := post(t, e.url, sim.PathChat, body)
			assert.Equal(t, http.StatusBadRequest, r.Status, string(r.Body))
		})
	}
}
