package sim_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

func cfgWith(mod func(*sim.Config)) sim.Config {
	c := sim.DefaultConfig()
	if mod != nil {
		mod(&c)
	}
	return c
}

func renderWith(t *testing.T, cfg sim.Config, body any) []sim.Token {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := cfg.ParseRequest(sim.PathChat, raw)
	require.NoError(t, err)
	return req.Prompt
}

func joined(toks []sim.Token) string {
	var sb strings.Builder
	for _, t := range toks {
		sb.WriteString(t.Text)
	}
	return sb.String()
}

// chatReply is a non-streaming chat answer's first message, raw.
func chatReply(t *testing.T, b []byte) map[string]json.RawMessage {
	t.Helper()
	var v struct {
		Choices []struct {
			Message map[string]json.RawMessage `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(b, &v), string(b))
	require.NotEmpty(t, v.Choices)
	return v.Choices[0].Message
}

func str(t *testing.T, raw json.RawMessage) string {
	t.Helper()
	var s string
	require.NoError(t, json.Unmarshal(raw, &s), string(raw))
	return s
}

// Qwen3's enable_thinking false: an empty think block ends the generation
// prompt, the model does not think, and the next turn does not render the
// block again.
func TestEnableThinkingFalse(t *testing.T) {
	cfg := cfgWith(func(c *sim.Config) { c.Reasoning = true })
	base := chat(msg{"user", "hello there"})
	tests := []struct {
		name string
		body map[string]any
	}{
		{"kwargs", with(base, "chat_template_kwargs", map[string]any{"enable_thinking": false})},
		{"reasoning_effort none", with(base, "reasoning_effort", "none")},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			text := joined(renderWith(t, cfg, tt.body))
			assert.True(t, strings.HasSuffix(text, "<|im_start|>assistant\n<think>\n\n</think>\n\n"), text)
			if tt.name == "kwargs" {
				assert.NotContains(t, text, "meta", "Qwen3 consumes enable_thinking; no other kwargs, no meta turn")
			}

			e := start(t, nil, nil, func(c *sim.Config) { c.Reasoning = true })
			status, b := postRaw(t, e.url, sim.PathChat, with(tt.body, "return_token_ids", true))
			require.Equal(t, http.StatusOK, status, string(b))
			m := chatReply(t, b)
			assert.Equal(t, "null", string(m["reasoning"]), "no reasoning without thinking")
			content := str(t, m["content"])
			assert.NotContains(t, content, "<think>")
			ids := parseIDs(t, sim.PathChat, b)
			assert.NotContains(t, ids.gen, uint32(151667), "no <think> generated")

			// The next turn renders the reply without the empty block, so D's
			// sequence (prompt + reply) is not a prefix of it.
			next := renderWith(t, cfg, with(tt.body, "messages", []msg{{"user", "hello there"}, {"assistant", content}, {"user", "more"}}))
			dSeq := append(append([]uint32(nil), ids.prompt...), ids.gen[:len(ids.gen)-1]...)
			assert.False(t, isPrefix(dSeq, tokIDs(next)), "D's blocks do not continue into the next prompt")
			assert.NotContains(t, joined(next)[:len(joined(next))-len(qwenThink)], "<think>", "past turns carry no think block")
		})
	}
	t.Run("enable_thinking true renders like no kwargs", func(t *testing.T) {
		assert.Equal(t, renderWith(t, cfg, base), renderWith(t, cfg, with(base, "chat_template_kwargs", map[string]any{"enable_thinking": true})))
	})
	t.Run("other kwargs still render", func(t *testing.T) {
		a := renderWith(t, cfg, with(base, "chat_template_kwargs", map[string]any{"enable_thinking": true, "x": 1}))
		assert.NotEqual(t, renderWith(t, cfg, base), a)
	})
}

const qwenThink = "<think>\n\n</think>\n\n"

// Without a reasoning parser the think block stays in the content, no
// reasoning is split out, and the template strips it from past turns.
func TestInlineReasoning(t *testing.T) {
	mod := func(c *sim.Config) { c.Reasoning, c.InlineReasoning = true, true }
	e := start(t, nil, nil, mod)
	body := chat(msg{"user", "tell me a story"})
	status, b := postRaw(t, e.url, sim.PathChat, with(body, "return_token_ids", true))
	require.Equal(t, http.StatusOK, status, string(b))
	m := chatReply(t, b)
	assert.Equal(t, "null", string(m["reasoning"]))
	content := str(t, m["content"])
	require.True(t, strings.HasPrefix(content, "<think>"), content)
	j := strings.Index(content, "</think>\n\n")
	require.Positive(t, j, content)
	cfg := e.Config()
	raw, _ := json.Marshal(body)
	req, err := cfg.ParseRequest(sim.PathChat, raw)
	require.NoError(t, err)
	ref := sim.Reference("sim-model", tokIDs(req.Prompt), cfg.GenParams(req, 0))
	want, reasoning := cfg.ChatContent(ref)
	assert.Equal(t, want, content)
	assert.Nil(t, reasoning)
	assert.Equal(t, sim.RawText(ref), content, "the content is every token's text")
	answer := content[j+len("</think>\n\n"):]
	assert.NotEmpty(t, answer)

	_, sb := postRaw(t, e.url, sim.PathChat, with(body, "return_token_ids", true, "stream", true))
	st := parseIDs(t, sim.PathChat, sb)
	assert.Equal(t, content, st.text, "the stream's content deltas carry the think block too")
	assert.NotContains(t, string(sb), `"reasoning":`)

	withThink := renderWith(t, cfg, chat(msg{"user", "tell me a story"}, msg{"assistant", content}, msg{"user", "more"}))
	without := renderWith(t, cfg, chat(msg{"user", "tell me a story"}, msg{"assistant", answer}, msg{"user", "more"}))
	assert.Equal(t, tokIDs(without), tokIDs(withThink))
}

// The reasoning key per engine generation, in messages and deltas.
func TestReasoningField(t *testing.T) {
	tests := []struct {
		field          string
		reasoning, old bool
	}{
		{sim.ReasoningFieldReasoning, true, false},
		{sim.ReasoningFieldContent, false, true},
		{sim.ReasoningFieldBoth, true, true},
	}
	for _, tt := range tests {
		t.Run(tt.field, func(t *testing.T) {
			e := start(t, nil, nil, func(c *sim.Config) { c.Reasoning, c.ReasoningField = true, tt.field })
			body := chat(msg{"user", "why"})
			_, b := postRaw(t, e.url, sim.PathChat, body)
			m := chatReply(t, b)
			_, hasR := m["reasoning"]
			_, hasRC := m["reasoning_content"]
			assert.Equal(t, tt.reasoning, hasR)
			assert.Equal(t, tt.old, hasRC)
			_, sb := postRaw(t, e.url, sim.PathChat, with(body, "stream", true))
			assert.Equal(t, tt.reasoning, strings.Contains(string(sb), `"delta":{"reasoning":`), string(sb))
			assert.Equal(t, tt.old, strings.Contains(string(sb), `"reasoning_content":`))
		})
	}
	t.Run("no reasoning: null", func(t *testing.T) {
		e := start(t, nil, nil, nil)
		_, b := postRaw(t, e.url, sim.PathChat, chat(msg{"user", "why"}))
		m := chatReply(t, b)
		assert.Equal(t, "null", string(m["reasoning"]))
		_, hasRC := m["reasoning_content"]
		assert.False(t, hasRC)
	})
}

// vLLM's ChatMessage drops an empty tool_calls list.
func TestEmptyToolCallsOmitted(t *testing.T) {
	e := start(t, nil, nil, nil)
	_, b := postRaw(t, e.url, sim.PathChat, chat(msg{"user", "hi"}))
	m := chatReply(t, b)
	assert.NotContains(t, m, "tool_calls")
	for _, k := range []string{"role", "content", "refusal", "annotations", "audio", "function_call", "reasoning"} {
		assert.Contains(t, m, k)
	}
}

func TestLlama3Template(t *testing.T) {
	cfg := cfgWith(func(c *sim.Config) { c.Template = sim.TemplateLlama3 })
	body := chat(msg{"system", "  be brief \n"}, msg{"user", "\nhello there  "})
	text := joined(renderWith(t, cfg, body))
	assert.Equal(t, "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nbe brief<|eot_id|>"+
		"<|start_header_id|>user<|end_header_id|>\n\nhello there<|eot_id|>"+
		"<|start_header_id|>assistant<|end_header_id|>\n\n", text)
	// prefix-stable across turns
	longer := renderWith(t, cfg, chat(msg{"system", "be brief"}, msg{"user", "hello there"}, msg{"assistant", "ok"}, msg{"user", "q"}))
	turn := renderWith(t, cfg, with(chat(msg{"system", "be brief"}, msg{"user", "hello there"}), "add_generation_prompt", false))
	assert.True(t, isPrefix(tokIDs(turn), tokIDs(longer)))
}

// Under the trimming template some replies end with whitespace before EOS;
// sent back verbatim, the next prompt renders it trimmed, so D's sequence
// is not a prefix of the next prompt.
func TestLlama3TrimMatters(t *testing.T) {
	mod := func(c *sim.Config) { c.Template = sim.TemplateLlama3 }
	e := start(t, nil, nil, mod)
	cfg := e.Config()
	found := 0
	for i := 0; i < 60 && found < 2; i++ {
		q := fmt.Sprintf("question number %d please", i)
		body := with(chat(msg{"user", q}), "return_token_ids", true)
		status, b := postRaw(t, e.url, sim.PathChat, body)
		require.Equal(t, http.StatusOK, status, string(b))
		ids := parseIDs(t, sim.PathChat, b)
		content := str(t, chatReply(t, b)["content"])
		require.Equal(t, uint32(128009), ids.gen[len(ids.gen)-1], "EOS is <|eot_id|>")
		if strings.TrimSpace(content) == content {
			continue
		}
		found++
		last := ids.gen[len(ids.gen)-2]
		assert.Contains(t, []string{" ", "\n"}, content[len(content)-1:])
		assert.NotEqual(t, uint32(128009), last)
		next := renderWith(t, cfg, chat(msg{"user", q}, msg{"assistant", content}, msg{"user", "more"}))
		dSeq := append(append([]uint32(nil), ids.prompt...), ids.gen[:len(ids.gen)-1]...)
		assert.False(t, isPrefix(dSeq, tokIDs(next)), "the trimmed reply diverges from D's blocks")
		trimmed := append(append([]uint32(nil), ids.prompt...), ids.gen[:len(ids.gen)-2]...)
		assert.True(t, isPrefix(trimmed, tokIDs(next)), "up to the trailing whitespace it still continues")
	}
	assert.Equal(t, 2, found, "the generator ends some replies with whitespace")
	assert.Zero(t, e.Stats().WrongOutputs)
}

func TestContentFormat(t *testing.T) {
	parts := func(texts ...string) map[string]any {
		var ps []any
		for _, s := range texts {
			ps = append(ps, map[string]any{"type": "text", "text": s})
		}
		return map[string]any{"messages": []any{map[string]any{"role": "user", "content": ps}}}
	}
	tests := []struct {
		format, want string
	}{
		{sim.ContentFormatString, "ab\ncd"},
		{sim.ContentFormatOpenAI, "abcd"},
	}
	for _, tt := range tests {
		t.Run(tt.format, func(t *testing.T) {
			cfg := cfgWith(func(c *sim.Config) { c.ContentFormat = tt.format })
			assert.Equal(t, tokIDs(renderWith(t, cfg, chat(msg{"user", tt.want}))), tokIDs(renderWith(t, cfg, parts("ab", "cd"))))
			assert.Equal(t, tokIDs(renderWith(t, cfg, chat(msg{"user", "ab"}))), tokIDs(renderWith(t, cfg, parts("ab"))), "one part renders like the string")
		})
	}
}

func TestVariantConfigValidation(t *testing.T) {
	tests := map[string]func(*sim.Config){
		"template":       func(c *sim.Config) { c.Template = "mistral" },
		"content format": func(c *sim.Config) { c.ContentFormat = "auto" },
		"reasoning":      func(c *sim.Config) { c.ReasoningField = "thoughts" },
	}
	for name, mod := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := sim.New(cfgWith(mod))
			assert.ErrorIs(t, err, sim.ErrInvalidConfig)
		})
	}
}

func mustParse(t *testing.T, cfg sim.Config, body any) *sim.Request {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := cfg.ParseRequest(sim.PathChat, raw)
	require.NoError(t, err)
	return req
}
