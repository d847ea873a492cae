package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
)

// Paths of the OpenAI Responses API and the Anthropic Messages API.
const (
	PathResponses       = "/v1/responses"
	PathResponsesRender = "/v1/responses/render"
	PathMessages        = "/v1/messages"
	PathMessagesRender  = "/v1/messages/render"
	PathCountTokens     = "/v1/messages/count_tokens"
)

// errNotFound marks errors answered with 404.
var errNotFound = errors.New("sim: not found")

// chatLike reports whether path is served through the chat machinery
// (vLLM renders Responses and Messages requests as chat).
func chatLike(path string) bool {
	return path == PathChat || path == PathResponses || path == PathMessages
}

// The Responses API and the Messages API reach the engine as vLLM sends
// them: converted to chat messages and rendered by the same chat template
// (vllm/entrypoints/openai/responses/utils.py construct_input_messages,
// vllm/entrypoints/anthropic/serving.py
// _convert_anthropic_to_openai_request). The conversion builds the chat
// body the template sees and a synthetic chat request map holding the
// sampling fields, so that everything downstream (roles, pulls, handles,
// costs, faults) is the chat path's.

// parseResponses parses a Responses API body (vLLM's ResponsesRequest).
//
// input is a string (one user message) or a list of items: message items
// (role user, system, developer: their content string or input_text /
// output_text parts as chat text parts; role assistant: the text of its
// first part only), function_call items (an assistant tool call, merged
// into the assistant message before it), function_call_output items (a
// tool message) and reasoning items (the assistant's reasoning, which the
// template drops from past turns); instructions come first as a system
// message. A final assistant message or reasoning item with status
// in_progress or incomplete is continued (continue_final_message).
// Function tools become chat tools {type, function: {name, description,
// parameters}}; reasoning.effort is chat's reasoning_effort. Without a
// response store (vLLM's default, VLLM_ENABLE_RESPONSES_API_STORE unset)
// store is ignored, background answers 400 and a previous_response_id
// answers 404 "Response with id '…' not found."; a prompt template answers
// 400 as in vLLM. include, prompt_cache_key, metadata, tool_choice,
// parallel_tool_calls, text, truncation, service_tier and user shape
// nothing (the response object echoes them).
func (c *Config) parseResponses(m map[string]json.RawMessage) (*Request, error) {
	b, err := responsesChatBody(m)
	if err != nil {
		return nil, err
	}
	prompt, err := c.renderChat(b)
	if err != nil {
		return nil, err
	}
	cm := pick(m, "model", "request_id", "stream", "ignore_eos", "stop", "kv_transfer_params")
	if v, ok := m["max_output_tokens"]; ok {
		cm["max_tokens"] = v
	}
	req, err := fillCommon(PathResponses, cm, prompt)
	if err != nil {
		return nil, renameField(err, "max_tokens", "max_output_tokens")
	}
	req.Path = PathResponses
	req.Thinking = c.thinking(b)
	if err := req.readTools(PathResponses, m["tool_choice"], b.Tools); err != nil {
		return nil, err
	}
	return req, nil
}

// pick copies the given keys of m that are present.
func pick(m map[string]json.RawMessage, keys ...string) map[string]json.RawMessage {
	out := map[string]json.RawMessage{}
	for _, k := range keys {
		if v, ok := m[k]; ok {
			out[k] = v
		}
	}
	return out
}

// renameField rewrites a parse error about the synthetic field from into
// the API's own name to.
func renameField(err error, from, to string) error {
	msg := err.Error()
	if !strings.Contains(msg, from+":") {
		return err
	}
	return badRequest("%s", strings.TrimPrefix(strings.Replace(msg, from+":", to+":", 1), errBadRequest.Error()+": "))
}

func responsesChatBody(m map[string]json.RawMessage) (*chatBody, error) {
	if present(m["prompt"]) {
		return nil, badRequest("prompt: prompt template is not supported")
	}
	background, err := laxBool(m, "background", false)
	if err != nil {
		return nil, err
	}
	if background {
		// store is off without a response store, and background needs it
		return nil, badRequest("background: This vLLM engine does not support `store=True` and therefore does not support the background mode. To enable these features, set the environment variable `VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.")
	}
	if v := m["previous_response_id"]; present(v) {
		var id string
		_ = json.Unmarshal(v, &id)
		return nil, fmt.Errorf("%w: Response with id '%s' not found.", errNotFound, id)
	}
	b := &chatBody{AddGenerationPrompt: true}
	var instructions string
	if err := laxString(m, "instructions", &instructions); err != nil {
		return nil, err
	}
	if instructions != "" {
		b.Messages = append(b.Messages, message{Role: "system", Content: jsonString(instructions)})
	}
	raw, ok := m["input"]
	if !ok || !present(raw) {
		return nil, badRequest("input: field required")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		b.Messages = append(b.Messages, message{Role: "user", Content: jsonString(s)})
	} else {
		var items []json.RawMessage
		if err := json.Unmarshal(raw, &items); err != nil {
			return nil, badRequest("input: must be a string or a list of items")
		}
		msgs, cont, err := responsesItems(items)
		if err != nil {
			return nil, err
		}
		b.Messages = append(b.Messages, msgs...)
		if cont {
			b.ContinueFinalMessage, b.AddGenerationPrompt = true, false
		}
	}
	if len(b.Messages) == 0 {
		return nil, badRequest("input: must not be empty")
	}
	tools, err := responsesTools(m["tools"])
	if err != nil {
		return nil, err
	}
	b.Tools = tools
	if v := m["reasoning"]; present(v) {
		r, err := decodeObject(v)
		if err != nil {
			return nil, badRequest("reasoning: must be an object")
		}
		if e := r["effort"]; present(e) {
			b.ReasoningEffort = e
		}
	}
	return b, nil
}

func jsonString(s string) json.RawMessage {
	b, _ := json.Marshal(s)
	return b
}

// responsesItems converts input items to chat messages as vLLM's
// construct_chat_messages_with_tool_call does; cont reports a partial final
// assistant item.
func responsesItems(items []json.RawMessage) (msgs []message, cont bool, err error) {
	// lastAssistant returns the previous message when it is the
	// assistant's, for merging.
	lastAssistant := func() *message {
		if n := len(msgs); n > 0 && msgs[n-1].Role == "assistant" {
			return &msgs[n-1]
		}
		return nil
	}
	for i, raw := range items {
		it, err := decodeObject(raw)
		if err != nil {
			return nil, false, badRequest("input[%d]: must be an object", i)
		}
		var typ, role, status string
		_ = laxString(it, "type", &typ)
		_ = laxString(it, "role", &role)
		_ = laxString(it, "status", &status)
		if i == len(items)-1 && (typ == "" || typ == "message" || typ == "reasoning") && role != "user" &&
			(status == "in_progress" || status == "incomplete") {
			cont = true
		}
		switch {
		case typ == "function_call":
			var name, args, callID string
			_ = laxString(it, "name", &name)
			_ = laxString(it, "arguments", &args)
			_ = laxString(it, "call_id", &callID)
			call := map[string]any{"id": callID, "type": "function", "function": map[string]any{"name": name, "arguments": args}}
			if p := lastAssistant(); p != nil {
				var calls []any
				_ = json.Unmarshal(p.ToolCalls, &calls)
				p.ToolCalls, _ = json.Marshal(append(calls, call))
				continue
			}
			tc, _ := json.Marshal([]any{call})
			msgs = append(msgs, message{Role: "assistant", ToolCalls: tc})
		case typ == "function_call_output":
			var callID string
			_ = laxString(it, "call_id", &callID)
			out, err := textParts(it["output"], "input_text", "output_text", "text")
			if err != nil {
				return nil, false, badRequest("input[%d].output: %v", i, err)
			}
			msgs = append(msgs, message{Role: "tool", Content: out, ToolCallID: callID})
		case typ == "reasoning":
			if present(it["encrypted_content"]) {
				return nil, false, badRequest("input[%d]: Encrypted content is not supported.", i)
			}
			// the reasoning text is kept apart from the content, and the
			// template drops it from past turns
			if p := lastAssistant(); p != nil && !p.hasReasoning {
				p.hasReasoning = true
				continue
			}
			msgs = append(msgs, message{Role: "assistant", hasReasoning: true})
		case typ == "" || typ == "message":
			if role == "" {
				return nil, false, badRequest("input[%d].role: field required", i)
			}
			if role == "assistant" {
				text, err := firstPartText(it["content"])
				if err != nil {
					return nil, false, badRequest("input[%d].%v", i, err)
				}
				if p := lastAssistant(); p != nil && p.Content == nil {
					p.Content = jsonString(text)
					continue
				}
				msgs = append(msgs, message{Role: "assistant", Content: jsonString(text)})
				continue
			}
			content, err := textParts(it["content"], "input_text", "output_text", "text")
			if err != nil {
				return nil, false, badRequest("input[%d].%v", i, err)
			}
			msgs = append(msgs, message{Role: role, Content: content})
		default:
			return nil, false, badRequest("input[%d]: the simulator does not serve %q items", i, typ)
		}
	}
	return msgs, cont, nil
}

// firstPartText is the text vLLM takes from an assistant message item: the
// string, or the first part's text.
func firstPartText(raw json.RawMessage) (string, error) {
	if !present(raw) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var parts []struct {
		Text string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return "", badRequest("content: must be a string or a list of parts")
	}
	if len(parts) == 0 {
		return "", nil
	}
	return parts[0].Text, nil
}

// textParts converts content (a string or a list of parts of the allowed
// text types) to chat content: the string, or a list of chat text parts.
func textParts(raw json.RawMessage, types ...string) (json.RawMessage, error) {
	if !present(raw) {
		return nil, nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return raw, nil
	}
	var parts []struct {
		Type string  `json:"type"`
		Text *string `json:"text"`
	}
	if err := json.Unmarshal(raw, &parts); err != nil {
		return nil, badRequest("content: must be a string or a list of parts")
	}
	out := make([]map[string]string, 0, len(parts))
	for _, p := range parts {
		ok := false
		for _, t := range types {
			ok = ok || p.Type == t
		}
		if !ok || p.Text == nil {
			return nil, badRequest("content: the simulator renders only text parts, got %q", p.Type)
		}
		out = append(out, map[string]string{"type": "text", "text": *p.Text})
	}
	b, _ := json.Marshal(out)
	return b, nil
}

// chatTool is a chat completions tool as the template sees it.
type chatTool struct {
	Type     string       `json:"type"`
	Function chatFunction `json:"function"`
}

type chatFunction struct {
	Name        string          `json:"name"`
	Description *string         `json:"description,omitempty"`
	Parameters  json.RawMessage `json:"parameters,omitempty"`
}

// responsesTools converts the function tools of a Responses request (flat
// {type, name, description, parameters, strict}, or chat-shaped) to chat
// tools; built-in tools are not rendered. nil when there are none.
func responsesTools(raw json.RawMessage) (json.RawMessage, error) {
	if !present(raw) {
		return nil, nil
	}
	var tools []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &tools); err != nil {
		return nil, badRequest("tools: must be a list of objects")
	}
	var out []chatTool
	for i, t := range tools {
		var typ string
		_ = laxString(t, "type", &typ)
		if typ != "function" {
			continue
		}
		f := t
		if fn := t["function"]; present(fn) && t["name"] == nil {
			if f, _ = decodeObject(fn); f == nil {
				return nil, badRequest("tools[%d].function: must be an object", i)
			}
		}
		ct := chatTool{Type: "function"}
		if err := laxString(f, "name", &ct.Function.Name); err != nil || ct.Function.Name == "" {
			return nil, badRequest("tools[%d].name: field required", i)
		}
		if d := f["description"]; present(d) {
			var s string
			if json.Unmarshal(d, &s) != nil {
				return nil, badRequest("tools[%d].description: Input should be a valid string", i)
			}
			ct.Function.Description = &s
		}
		if p := f["parameters"]; present(p) {
			ct.Function.Parameters = p
		}
		out = append(out, ct)
	}
	if len(out) == 0 {
		return nil, nil
	}
	b, _ := json.Marshal(out)
	return b, nil
}

// parseMessages parses an Anthropic Messages body (vLLM's
// AnthropicMessagesRequest) as vLLM converts it to a chat request:
//
//   - system (a string, or text blocks whose texts are concatenated with no
//     separator, skipping x-anthropic-billing-header blocks; cache_control
//     ignored) and the texts of any system-role messages become one system
//     message;
//   - a message's content string stays a string; blocks: text blocks are
//     chat text parts (one alone is the string), thinking blocks the
//     assistant's reasoning (dropped by the template from past turns),
//     tool_use blocks assistant tool calls, and a user's tool_result block
//     a tool message placed before the user message (whose remaining
//     content, if none, drops the user message);
//   - tools {name, description, input_schema} become chat tools (an
//     input_schema without "type" gets "type": "object");
//   - stop_sequences are stop strings, output_config.effort is
//     reasoning_effort, chat_template_kwargs pass through, metadata is
//     ignored, and so is thinking (vLLM reads none of it: whether the model
//     thinks is the reasoning parser's and the chat template's business).
//
// model and max_tokens (at least 1) are required; stream adds chat's
// include_usage.
func (c *Config) parseMessages(m map[string]json.RawMessage, counting bool) (*Request, error) {
	b, err := messagesChatBody(m)
	if err != nil {
		return nil, err
	}
	prompt, err := c.renderChat(b)
	if err != nil {
		return nil, err
	}
	cm := pick(m, "model", "kv_transfer_params")
	if v, ok := m["stop_sequences"]; ok {
		cm["stop"] = v
	}
	if !counting {
		for _, k := range []string{"stream", "max_tokens"} {
			if v, ok := m[k]; ok {
				cm[k] = v
			}
		}
		mt, ok, err := laxIntPtr(m, "max_tokens")
		switch {
		case err != nil:
			return nil, err
		case !ok:
			return nil, badRequest("max_tokens: field required")
		case mt <= 0:
			return nil, badRequest("max_tokens: max_tokens must be positive")
		}
	}
	req, err := fillCommon(PathMessages, cm, prompt)
	if err != nil {
		return nil, err
	}
	if req.Model == "" {
		return nil, badRequest("model: Model is required")
	}
	req.IncludeUsage = req.Stream
	req.Thinking = c.thinking(b)
	if err := req.readTools(PathMessages, m["tool_choice"], b.Tools); err != nil {
		return nil, err
	}
	return req, nil
}

// anthropicBlock is an Anthropic content block, the fields vLLM reads.
type anthropicBlock struct {
	Type      string          `json:"type"`
	Text      *string         `json:"text"`
	ID        string          `json:"id"`
	ToolUseID string          `json:"tool_use_id"`
	Name      string          `json:"name"`
	Input     json.RawMessage `json:"input"`
	Content   json.RawMessage `json:"content"`
	Thinking  *string         `json:"thinking"`
}

const billingHeader = "x-anthropic-billing-header"

func messagesChatBody(m map[string]json.RawMessage) (*chatBody, error) {
	var model string
	if err := laxString(m, "model", &model); err != nil {
		return nil, err
	}
	if model == "" {
		return nil, badRequest("model: Model is required")
	}
	b := &chatBody{AddGenerationPrompt: true, ChatTemplateKwargs: m["chat_template_kwargs"]}
	raw, ok := m["messages"]
	if !ok || !present(raw) {
		return nil, badRequest("messages: field required")
	}
	var msgs []struct {
		Role    string          `json:"role"`
		Content json.RawMessage `json:"content"`
	}
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return nil, badRequest("messages: must be a list of messages")
	}
	if len(msgs) == 0 {
		return nil, badRequest("messages: messages must contain at least one item")
	}
	var system []string
	// systemTexts collects system texts: a top-level empty string is no
	// system prompt, a system message's empty string still is one, as in
	// vLLM
	systemTexts := func(raw json.RawMessage, where string) error {
		if !present(raw) {
			return nil
		}
		var s string
		if json.Unmarshal(raw, &s) == nil {
			if s != "" || where != "system" {
				system = append(system, s)
			}
			return nil
		}
		var blocks []anthropicBlock
		if err := json.Unmarshal(raw, &blocks); err != nil {
			return badRequest("%s: must be a string or a list of blocks", where)
		}
		for _, bl := range blocks {
			if bl.Type == "text" && bl.Text != nil && *bl.Text != "" && !strings.HasPrefix(*bl.Text, billingHeader) {
				system = append(system, *bl.Text)
			}
		}
		return nil
	}
	if err := systemTexts(m["system"], "system"); err != nil {
		return nil, err
	}
	for i := range msgs {
		switch msgs[i].Role {
		case "ctx", "msg": // Claude Code's roles, as vLLM maps them
			msgs[i].Role = "user"
		case "user", "assistant":
		case "system":
			if err := systemTexts(msgs[i].Content, fmt.Sprintf("messages[%d].content", i)); err != nil {
				return nil, err
			}
		default:
			return nil, badRequest("messages[%d].role: Input should be 'user', 'assistant' or 'system'", i)
		}
	}
	if len(system) > 0 {
		b.Messages = append(b.Messages, message{Role: "system", Content: jsonString(strings.Join(system, ""))})
	}
	for i, msg := range msgs {
		if msg.Role == "system" {
			continue
		}
		if !present(msg.Content) {
			return nil, badRequest("messages[%d].content: field required", i)
		}
		var s string
		if json.Unmarshal(msg.Content, &s) == nil {
			b.Messages = append(b.Messages, message{Role: msg.Role, Content: msg.Content})
			continue
		}
		var blocks []anthropicBlock
		if err := json.Unmarshal(msg.Content, &blocks); err != nil {
			return nil, badRequest("messages[%d].content: must be a string or a list of blocks", i)
		}
		if len(blocks) == 0 {
			return nil, badRequest("messages[%d].content: message content must not be empty", i)
		}
		out := message{Role: msg.Role}
		var parts []map[string]string
		var calls []any
		for j, bl := range blocks {
			switch bl.Type {
			case "text":
				if bl.Text != nil && *bl.Text != "" {
					parts = append(parts, map[string]string{"type": "text", "text": *bl.Text})
				}
			case "thinking":
				if bl.Thinking != nil {
					out.hasReasoning = true
				}
			case "redacted_thinking", "tool_reference":
			case "tool_use":
				input := bl.Input
				if !present(input) {
					input = json.RawMessage("{}")
				}
				calls = append(calls, map[string]any{"id": bl.ID, "type": "function",
					"function": map[string]any{"name": bl.Name, "arguments": string(input)}})
			case "tool_result":
				text, err := toolResultText(bl.Content)
				if err != nil {
					return nil, badRequest("messages[%d].content[%d].%v", i, j, err)
				}
				if msg.Role == "user" {
					b.Messages = append(b.Messages, message{Role: "tool", ToolCallID: bl.ToolUseID, Content: jsonString(text)})
				} else {
					parts = append(parts, map[string]string{"type": "text", "text": "Tool result: " + text})
				}
			default:
				return nil, badRequest("messages[%d].content[%d]: the simulator renders no %q blocks", i, j, bl.Type)
			}
		}
		if len(calls) > 0 {
			out.ToolCalls, _ = json.Marshal(calls)
		}
		switch {
		case len(parts) == 1:
			out.Content = jsonString(parts[0]["text"])
		case len(parts) > 1:
			out.Content, _ = json.Marshal(parts)
		}
		if msg.Role == "user" && out.Content == nil {
			continue // vLLM drops a user message left without content
		}
		b.Messages = append(b.Messages, out)
	}
	if len(b.Messages) == 0 {
		return nil, badRequest("messages: nothing to render")
	}
	tools, err := messagesTools(m["tools"])
	if err != nil {
		return nil, err
	}
	b.Tools = tools
	if v := m["tool_choice"]; present(v) {
		tc, err := decodeObject(v)
		if err != nil {
			return nil, badRequest("tool_choice: must be an object")
		}
		var typ, name string
		_ = laxString(tc, "type", &typ)
		_ = laxString(tc, "name", &name)
		if !oneOf(typ, "auto", "any", "tool", "none") || typ == "" {
			return nil, badRequest("tool_choice.type: Input should be 'auto', 'any', 'tool' or 'none'")
		}
		if typ == "tool" && name == "" {
			return nil, badRequest("tool_choice: tool_choice.name is required when type is 'tool'")
		}
	}
	if v := m["output_config"]; present(v) {
		oc, err := decodeObject(v)
		if err != nil {
			return nil, badRequest("output_config: must be an object")
		}
		if e := oc["effort"]; present(e) {
			b.ReasoningEffort = e
		}
	}
	if present(b.ChatTemplateKwargs) {
		if _, err := decodeObject(b.ChatTemplateKwargs); err != nil {
			return nil, badRequest("chat_template_kwargs: must be an object")
		}
	}
	return b, nil
}

// toolResultText is a tool_result block's content as vLLM renders it: the
// string, or its text blocks joined with "\n".
func toolResultText(raw json.RawMessage) (string, error) {
	if !present(raw) {
		return "", nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return s, nil
	}
	var blocks []anthropicBlock
	if err := json.Unmarshal(raw, &blocks); err != nil {
		return "", badRequest("content: must be a string or a list of blocks")
	}
	var texts []string
	for _, bl := range blocks {
		if bl.Type == "text" && bl.Text != nil {
			texts = append(texts, *bl.Text)
		}
	}
	return strings.Join(texts, "\n"), nil
}

// messagesTools converts Anthropic tools to chat tools.
func messagesTools(raw json.RawMessage) (json.RawMessage, error) {
	if !present(raw) {
		return nil, nil
	}
	var tools []map[string]json.RawMessage
	if err := json.Unmarshal(raw, &tools); err != nil {
		return nil, badRequest("tools: must be a list of objects")
	}
	out := make([]chatTool, 0, len(tools))
	for i, t := range tools {
		ct := chatTool{Type: "function"}
		if err := laxString(t, "name", &ct.Function.Name); err != nil || ct.Function.Name == "" {
			return nil, badRequest("tools[%d].name: field required", i)
		}
		if d := t["description"]; present(d) {
			var s string
			if json.Unmarshal(d, &s) != nil {
				return nil, badRequest("tools[%d].description: Input should be a valid string", i)
			}
			ct.Function.Description = &s
		}
		schema, err := decodeObject(t["input_schema"])
		if err != nil {
			return nil, badRequest("tools[%d].input_schema: input_schema must be a dictionary", i)
		}
		if _, ok := schema["type"]; !ok {
			schema["type"] = json.RawMessage(`"object"`)
		}
		ct.Function.Parameters, _ = json.Marshal(schema)
		out = append(out, ct)
	}
	b, _ := json.Marshal(out)
	return b, nil
}
