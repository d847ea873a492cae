package sim

import (
	"bytes"
	"encoding/json"
	"strings"
)

// Chat template families of Config.Template.
const (
	// TemplateChatML is the default, ChatML-like as Qwen3's.
	TemplateChatML = "chatml"
	// TemplateLlama3 is Llama-3-Instruct's: header tokens, <|eot_id|>,
	// and every message's content trimmed of surrounding whitespace.
	TemplateLlama3 = "llama3"
)

// Content formats of Config.ContentFormat (vLLM's
// --chat-template-content-format).
const (
	// ContentFormatString joins a message's text parts with "\n" into one
	// string before the template sees it (vLLM's "string").
	ContentFormatString = "string"
	// ContentFormatOpenAI passes the parts as a list; the template
	// concatenates their texts with no separator (vLLM's "openai").
	ContentFormatOpenAI = "openai"
)

// Llama-3 special tokens.
const (
	TokBeginOfText = "<|begin_of_text|>"
	TokStartHeader = "<|start_header_id|>"
	TokEndHeader   = "<|end_header_id|>"
	TokEOT         = "<|eot_id|>"
)

// qwenEmptyThink is what Qwen3's template appends to the generation prompt
// when enable_thinking is false.
const qwenEmptyThink = TokThinkOpen + "\n\n" + TokThinkClose + "\n\n"

func (c *Config) template() string {
	if c.Template == "" {
		return TemplateChatML
	}
	return c.Template
}

// eos is the template's end-of-turn token, the model's EOS.
func (c *Config) eos() string {
	if c.template() == TemplateLlama3 {
		return TokEOT
	}
	return TokIMEnd
}

// renderChat renders a chat body with the configured template.
//
// TemplateChatML, ChatML-like as Qwen3's:
//
//	[<|endoftext|>]                                   when add_special_tokens is true
//	<|im_start|>meta\n{canonical JSON}<|im_end|>\n   when any of chat_template,
//	                                                  chat_template_kwargs (but
//	                                                  enable_thinking), documents,
//	                                                  reasoning_effort is set
//	<|im_start|>system\n{system}\n\n# Tools\n{tools JSON}<|im_end|>\n   when tools are given
//	<|im_start|>{role}\n{content}<|im_end|>\n        per message, in order
//	<|im_start|>assistant\n                           when add_generation_prompt (default true)
//	<think>\n\n</think>\n\n                          after it when enable_thinking is false
//
// enable_thinking comes from chat_template_kwargs or, when absent there,
// from reasoning_effort ("none" disables it) as vLLM passes it. Past
// assistant content loses everything up to its last </think> and the
// newlines after it, and reasoning_content is dropped, as Qwen3's template
// does (so an empty think block of a non-thinking turn is not rendered
// again either); assistant tool_calls render after the content as
// Qwen3's template renders them (renderToolCalls).
//
// TemplateLlama3, as Llama-3-Instruct's (the sim's meta and tools turns
// added the same way):
//
//	<|begin_of_text|>                                 before the first message
//	<|start_header_id|>{role}<|end_header_id|>\n\n{content | trim}<|eot_id|>
//	<|start_header_id|>assistant<|end_header_id|>\n\n  when add_generation_prompt
//
// Content is a string or an array of text parts, joined with "\n"
// (ContentFormatString) or concatenated (ContentFormatOpenAI); either way a
// single text part renders exactly like the string. With
// continue_final_message the last message is left open and no generation
// prompt is added. Every JSON value is rendered canonically (sorted keys),
// so any change to a prompt-shaping field changes the tokens.
func (c *Config) renderChat(b *chatBody) ([]Token, error) {
	llama := c.template() == TemplateLlama3
	turn := writeTurn
	if llama {
		turn = writeLlamaTurn
	}
	var sb strings.Builder
	if b.AddSpecialTokens {
		if llama {
			sb.WriteString(TokBeginOfText)
		} else {
			sb.WriteString(TokEndOfText)
		}
	}
	if llama {
		sb.WriteString(TokBeginOfText) // the template's bos_token
	}
	meta := map[string]json.RawMessage{}
	if b.ChatTemplate != nil {
		v, _ := json.Marshal(*b.ChatTemplate)
		meta["chat_template"] = v
	}
	kwargs := b.ChatTemplateKwargs
	if !llama {
		kwargs = withoutKey(kwargs, "enable_thinking") // Qwen3 consumes it
	}
	for k, v := range map[string]json.RawMessage{
		"chat_template_kwargs": kwargs,
		"documents":            b.Documents,
		"reasoning_effort":     b.ReasoningEffort,
	} {
		if present(v) {
			meta[k] = v
		}
	}
	if len(meta) > 0 {
		raw, _ := json.Marshal(meta)
		s, err := canonical(raw)
		if err != nil {
			return nil, err
		}
		turn(&sb, "meta", s, true)
	}
	msgs := b.Messages
	if present(b.Tools) {
		tools, err := canonical(b.Tools)
		if err != nil {
			return nil, badRequest("tools: %v", err)
		}
		sys := ""
		if msgs[0].Role == "system" {
			s, err := contentText(msgs[0].Content, c.ContentFormat)
			if err != nil {
				return nil, err
			}
			sys = s + "\n\n"
			msgs = msgs[1:]
		}
		turn(&sb, "system", sys+"# Tools\n"+tools, true)
	}
	for i, m := range msgs {
		last := i == len(msgs)-1
		text, err := contentText(m.Content, c.ContentFormat)
		if err != nil {
			return nil, err
		}
		if m.Role == "" {
			return nil, badRequest("messages[%d].role: field required", i)
		}
		if m.Role == "assistant" {
			if j := strings.LastIndex(text, TokThinkClose); j >= 0 && !llama {
				text = strings.TrimLeft(text[j+len(TokThinkClose):], "\n")
			}
			calls, err := renderToolCalls(m.ToolCalls, text != "")
			if err != nil {
				return nil, err
			}
			text += calls
		}
		turn(&sb, m.Role, text, !(last && b.ContinueFinalMessage))
	}
	if b.AddGenerationPrompt && !b.ContinueFinalMessage {
		if llama {
			sb.WriteString(TokStartHeader + "assistant" + TokEndHeader + "\n\n")
		} else {
			sb.WriteString(TokIMStart + "assistant\n")
			if !c.thinking(b) {
				sb.WriteString(qwenEmptyThink)
			}
		}
	}
	return Tokenize(sb.String()), nil
}

// withoutKey returns the JSON object raw without key (nil when nothing is
// left); raw itself when it is not an object.
func withoutKey(raw json.RawMessage, key string) json.RawMessage {
	var m map[string]json.RawMessage
	if !present(raw) || json.Unmarshal(raw, &m) != nil {
		return raw
	}
	if _, ok := m[key]; !ok {
		return raw
	}
	delete(m, key)
	if len(m) == 0 {
		return nil
	}
	out, _ := json.Marshal(m)
	return out
}

func (e *Engine) renderChat(b *chatBody) ([]Token, error) { return e.cfg.renderChat(b) }

// thinking reports whether the model thinks for this body (Qwen3's
// enable_thinking; always under TemplateLlama3): not when
// chat_template_kwargs.enable_thinking is false, nor when reasoning_effort
// is "none" and enable_thinking is not given (vLLM's build_chat_params sets
// enable_thinking = reasoning_effort != "none").
func (c *Config) thinking(b *chatBody) bool {
	if c.template() == TemplateLlama3 {
		return true
	}
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

// writeLlamaTurn writes one Llama-3 message; its content is trimmed as the
// template's "| trim" does.
func writeLlamaTurn(sb *strings.Builder, role, content string, closed bool) {
	sb.WriteString(TokStartHeader)
	sb.WriteString(role)
	sb.WriteString(TokEndHeader + "\n\n")
	sb.WriteString(strings.TrimSpace(content))
	if closed {
		sb.WriteString(TokEOT)
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

// contentText renders message content: a string, null, or text parts
// (joined with "\n" for ContentFormatString and "", concatenated for
// ContentFormatOpenAI).
func contentText(raw json.RawMessage, format string) (string, error) {
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
	if format == ContentFormatOpenAI {
		return strings.Join(texts, ""), nil
	}
	return strings.Join(texts, "\n"), nil
}

// renderToolCalls renders an assistant message's tool calls as Qwen3's
// template does: "\n" before each call but a first one after empty
// content, then <tool_call>\n{"name": NAME, "arguments": ARGS}\n</tool_call>,
// ARGS the arguments' JSON with sorted keys in tojson's (Python's)
// spacing; arguments that are not JSON render as given.
func renderToolCalls(raw json.RawMessage, content bool) (string, error) {
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
	for i, c := range calls {
		args := c.Function.Arguments
		// arguments arrive as a JSON string holding JSON; render the inner value
		var s string
		if json.Unmarshal(args, &s) == nil {
			args = json.RawMessage(s)
		}
		a, err := canonical(args)
		if err != nil {
			a = string(args)
		} else {
			a = pyJSON(a)
		}
		name, _ := json.Marshal(c.Function.Name)
		if i > 0 || content {
			sb.WriteString("\n")
		}
		sb.WriteString("<tool_call>\n{\"name\": " + string(name) + ", \"arguments\": " + a + "}\n</tool_call>")
	}
	return sb.String(), nil
}
