package sim_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

func texts(toks []sim.Token) []string {
	out := make([]string, len(toks))
	for i, t := range toks {
		out[i] = t.Text
	}
	return out
}

func TestTokenize(t *testing.T) {
	tests := []struct {
		in   string
		want []string
	}{
		{"hello world", []string{"hello", " world"}},
		{"a  b", []string{"a", " ", " b"}},
		{"x\n\ny", []string{"x", "\n\n", "y"}},
		{"hi, there!", []string{"hi", ",", " there", "!"}},
		{"<|im_start|>user\nhey<|im_end|>\n", []string{"<|im_start|>", "user", "\n", "hey", "<|im_end|>", "\n"}},
		{"ab<think>c", []string{"ab", "<think>", "c"}},
		{"naïve 42", []string{"naïve", " 42"}},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			assert.Equal(t, tt.want, texts(sim.Tokenize(tt.in)))
			assert.Equal(t, tt.in, strings.Join(texts(sim.Tokenize(tt.in)), ""))
		})
	}
}

func render(t *testing.T, body any) []uint32 {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := sim.ParseRequest(sim.PathChat, raw)
	require.NoError(t, err)
	out := make([]uint32, len(req.Prompt))
	for i, tk := range req.Prompt {
		out[i] = tk.ID
	}
	return out
}

func isPrefix(a, b []uint32) bool {
	if len(a) > len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// The previous rendered prompt plus the reply tokens (minus the final stop
// token, which D never computes) is a prefix of the next turn's prompt when
// the reply comes back unchanged, and stops being one when it is edited.
func TestTemplatePrefixStable(t *testing.T) {
	first := chat(msg{"system", "be brief"}, msg{"user", "tell me a story"})
	prompt := render(t, first)
	g := sim.Reference("sim-model", prompt, sim.GenParams{})
	require.Equal(t, "stop", g.Finish)
	held := append(append([]uint32(nil), prompt...), tokIDs(g.Tokens[:len(g.Tokens)-1])...)

	next := func(reply string) []uint32 {
		return render(t, chat(msg{"system", "be brief"}, msg{"user", "tell me a story"}, msg{"assistant", reply}, msg{"user", "again"}))
	}
	assert.True(t, isPrefix(held, next(g.Content)), "unchanged reply")
	assert.False(t, isPrefix(held, next("edited"+g.Content[strings.Index(g.Content, " "):])), "edited reply")
	assert.False(t, isPrefix(held, next(strings.TrimSuffix(g.Content, lastWord(g.Content)))), "truncated reply")
}

func lastWord(s string) string { f := strings.Fields(s); return " " + f[len(f)-1] }

func tokIDs(toks []sim.Token) []uint32 {
	out := make([]uint32, len(toks))
	for i, t := range toks {
		out[i] = t.ID
	}
	return out
}

// Every prompt-shaping field changes the rendered tokens.
func TestTemplateShapingFields(t *testing.T) {
	base := chat(msg{"user", "hi"})
	baseToks := render(t, base)
	tests := map[string]map[string]any{
		"chat_template":          with(base, "chat_template", "{{ x }}"),
		"chat_template_kwargs":   with(base, "chat_template_kwargs", map[string]any{"enable_thinking": false}),
		"add_special_tokens":     with(base, "add_special_tokens", true),
		"continue_final_message": with(base, "continue_final_message", true, "add_generation_prompt", false),
		"add_generation_prompt":  with(base, "add_generation_prompt", false),
		"documents":              with(base, "documents", []any{map[string]any{"text": "d"}}),
		"reasoning_effort":       with(base, "reasoning_effort", "low"),
		"tools":                  with(base, "tools", []any{map[string]any{"type": "function", "function": map[string]any{"name": "f"}}}),
		"truncate_prompt_tokens": with(base, "truncate_prompt_tokens", 3),
	}
	for name, body := range tests {
		t.Run(name, func(t *testing.T) {
			assert.NotEqual(t, baseToks, render(t, body))
		})
	}
	t.Run("text parts render like a string", func(t *testing.T) {
		parts := map[string]any{"messages": []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": "hi"}}}}}
		assert.Equal(t, baseToks, render(t, parts))
	})
	t.Run("reasoning dropped from past assistant turns", func(t *testing.T) {
		a := render(t, chat(msg{"user", "q"}, msg{"assistant", "<think>\nhmm</think>\n\nanswer"}, msg{"user", "q2"}))
		b := render(t, chat(msg{"user", "q"}, msg{"assistant", "answer"}, msg{"user", "q2"}))
		assert.Equal(t, b, a)
	})
	t.Run("tool calls and tool messages render", func(t *testing.T) {
		call := []any{map[string]any{"id": "c1", "type": "function", "function": map[string]any{"name": "f", "arguments": `{"a":1}`}}}
		withCall := map[string]any{"messages": []any{
			map[string]any{"role": "user", "content": "q"},
			map[string]any{"role": "assistant", "content": nil, "tool_calls": call},
			map[string]any{"role": "tool", "tool_call_id": "c1", "content": "42"},
		}}
		noCall := map[string]any{"messages": []any{
			map[string]any{"role": "user", "content": "q"},
			map[string]any{"role": "assistant", "content": nil},
			map[string]any{"role": "tool", "tool_call_id": "c1", "content": "42"},
		}}
		assert.NotEqual(t, render(t, noCall), render(t, withCall))
	})
}

func TestCompletionPrompt(t *testing.T) {
	tests := []struct {
		name   string
		prompt any
		n      int
	}{
		{"string", "hello world", 2},
		{"one string in a list", []string{"hello world"}, 2},
		{"token ids", []int{1, 2, 3, 4}, 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			raw, _ := json.Marshal(map[string]any{"prompt": tt.prompt})
			req, err := sim.ParseRequest(sim.PathCompletions, raw)
			require.NoError(t, err)
			assert.Len(t, req.Prompt, tt.n)
		})
	}
}
