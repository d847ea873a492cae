package sim

import (
	"bytes"
	"encoding/json"
	"strings"
)

// The chat template, ChatML-like as Qwen's:
//
//	[<|endoftext|>]                                   when add_special_tokens is true
//	<|im_start|>meta\n{canonical JSON}<|im_end|>\n   when any of chat_template,
//	                                                  chat_template_kwargs, documents,
//	                                                  reasoning_effort is set
//	<|im_start|>system\n{system}\n\n# Tools\n{tools JSON}<|im_end|>\n   when tools are given
//	<|im_start|>{role}\n{content}<|im_end|>\n        per message, in order
//	<|im_start|>assistant\n                           when add_generation_prompt (default true)
//
// Content is a string or an array of text parts joined with "\n" (so a single
// text part renders exactly like the string). Past assistant content loses
// everything up to its last </think> and the newlines after it, and
// reasoning_content is dropped, as Qwen3's template does; assistant tool_calls
// render as "\n<tool_call>\n{name, arguments JSON}\n</tool_call>" after the
// content. With continue_final_message the last message is left open (no
// <|im_end|>\n) and no generation prompt is added. Every JSON value is
// rendered canonically (sorted keys), so any change to a prompt-shaping field
// changes the tokens.
func (c *Config) renderChat(b *chatBody) ([]Token, error) {
	var sb strings.Builder
	if b.AddSpecialTokens {
		sb.WriteString(TokEndOfText)
	}
	meta := map[string]json.RawMessage{}
	if b.ChatTemplate != nil {
		v, _ := json.Marshal(*b.ChatTemplate)
		meta["chat_template"] = v
	}
	for k, v := range map[string]json.RawMessage{
		"chat_template_kwargs": b.ChatTemplateKwargs,
		"documents":            b.Documents,
		"reasoning_effort":     b.ReasoningEffort,
	} {
		if present(v) {
			meta[k] = v
		}
	}
	if len(meta) > 0 {
		raw, _ := json.Marshal(meta)
		c, err := canonical(raw)
		if err != nil {
			return nil, err
		}
		writeTurn(&sb, "meta", c, true)
	}
	msgs := b.Messages
	if present(b.Tools) {
		tools, err := canonical(b.Tools)
		if err != nil {
			return nil, badRequest("tools: %v", err)
		}
		sys := ""
		if msgs[0].Role == "system" {
			s, err := contentText(msgs[0].Content)
			if err != nil {
				return nil, err
			}
			sys = s + "\n\n"
			msgs = msgs[1:]
		}
		writeTurn(&sb, "system", sys+"# Tools\n"+tools, true)
	}
	for i, m := range msgs {
		last := i == len(msgs)-1
		text, err := contentText(m.Content)
		if err != nil {
			return nil, err
		}
		if m.Role == "" {
			return nil, badRequest("messages[%d].role: field required", i)
		}
		if m.Role == "assistant" {
			if j := strings.LastIndex(text, TokThinkClose); j >= 0 {
				text = strings.TrimLeft(text[j+len(TokThinkClose):], "\n")
			}
			calls, err := renderToolCalls(m.ToolCalls)
			if err != nil {
				return nil, err
			}
			text += calls
		}
		writeTurn(&sb, m.Role, text, !(last && b.ContinueFinalMessage))
	}
	if b.AddGenerationPrompt && !b.ContinueFinalMessage {
		sb.WriteString(TokIMStart + "assistant\n")
	}
	return Tokenize(sb.String()), nil
}

func (e *Engine) renderChat(b *chatBody) ([]Token, error) { return e.cfg.renderChat(b) }

// thinking reports whether the model thinks for this body: not when
// chat_template_kwargs.enable_thinking is false, nor when reasoning_effort
// is "none" and enable_thinking is not given (vLLM's build_chat_params sets
// enable_thinking = reasoning_effort != "none").
func (c *Config) thinking(b *chatBody) bool {
	var kw map[string]json.RawMessage
	_ = json.Unmarshal(b.ChatTemplateKwargs, &kw)
	if v, ok := kw["enable_thinking"]; ok {
		var on bool
		if json.Unmarshal(v, &on) == nil {
			return on
		}
		return true
	}
	var effort string
	if json.Unmarshal(b.ReasoningEffort, &effort) == nil && effort == "none" {
		return false
	}
	return true
}

func writeTurn(sb *strings.Builder, role, content string, closed bool) {
	sb.WriteString(TokIMStart)
	sb.WriteString(role)
	sb.WriteString("\n")
	sb.WriteString(content)
	if closed {
		sb.WriteString(TokIMEnd + "\n")
	}
}

func present(raw json.RawMessage) bool {
	raw = bytes.TrimSpace(raw)
	return len(raw) > 0 && !bytes.Equal(raw, []byte("null"))
}

// canonical re-encodes a JSON value with sorted keys and exact numbers.
func canonical(raw json.RawMessage) (string, error) {
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return "", badRequest("invalid JSON value: %v", err)
	}
	out, err := json.Marshal(v)
	if err != nil {
		return "", badRequest("invalid JSON value: %v", err)
	}
	return string(out), nil
}

// contentText renders message content: a string, null, or text parts.
func contentText(raw json.RawMessage) (string, error) {
	if !present(raw) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest("content: must be a string or a list of parts")
	}
	texts := make([]string, 0, len(parts))
	for _, p := range parts {
		if p.Type != "text" || p.Text == nil {
			return "", badRequest("content: the simulator renders only text parts, got %q", p.Type)
		}
		texts = append(texts, *p.Text)
	}
	return strings.Join(texts, "\n"), nil
}

func renderToolCalls(raw json.RawMessage) (string, error) {
	if !present(raw) {
		return "", nil
	}
	var calls []struct {
		Function struct {
			Name      string          `json:"name"`
			Arguments json.RawMessage `json:"arguments"`
		} `json:"function"`
	}
	if err := json.Unmarshal(raw, &calls); err != nil {
		return "", badRequest("tool_calls: %v", err)
	}
	var sb strings.Builder
	for _, c := range calls {
		args := c.Function.Arguments
		// arguments arrive as a JSON string holding JSON; render the inner value
		var s string
		if json.Unmarshal(args, &s) == nil {
			args = json.RawMessage(s)
		}
		a, err := canonical(args)
		if err != nil {
			a = string(args)
		}
		name, _ := json.Marshal(c.Function.Name)
		sb.WriteString("\n<tool_call>\n{\"arguments\":" + a + ",\"name\":" + string(name) + "}\n</tool_call>")
	}
	return sb.String(), nil
}
