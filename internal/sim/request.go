package sim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
)

// Paths served by the engine.
const (
	PathChat        = "/v1/chat/completions"
	PathCompletions = "/v1/completions"
)

// Request is the part of an OpenAI request body the simulator acts on.
type Request struct {
	Path   string
	Model  string
	Stream bool
	// ToolName is the function a named tool_choice forces (chat
	// {"type": "function", "function": {"name": ...}}, Responses {"type":
	// "function", "name"}, Messages {"type": "tool", "name"}): the reply is
	// that tool's call, the generated text its arguments (vLLM's guided
	// decoding would make them JSON; the simulator's words are not). ""
	// otherwise.
	ToolName string
	// ToolChoice is ToolChoiceAuto or ToolChoiceRequired when the request
	// has tools and lets or makes the model call one (toolcall.go), ""
	// otherwise (none, named, no tools).
	ToolChoice string
	// Tools are the request's function tools.
	Tools []Tool
	// IncludeUsage is stream_options.include_usage.
	IncludeUsage bool
	MaxTokens    int // 0 when absent
	MinTokens    int
	IgnoreEOS    bool
	N            int
	Stop         []string
	// Prompt is the rendered prompt.
	Prompt []Token
	// KVParams is the raw kv_transfer_params value (nil when absent or null).
	KVParams json.RawMessage
	// ReturnTokenIDs is return_token_ids (vLLM PR #22587): the response
	// carries prompt_token_ids and each choice's token_ids.
	ReturnTokenIDs bool
	// Logprobs is set when the request asks for logprobs (chat's logprobs
	// true, completions' logprobs given) and TopLogprobs is how many
	// alternatives per position (chat's top_logprobs, completions'
	// logprobs); see logprobs.go.
	Logprobs    bool
	TopLogprobs int
	// BodyRequestID is the body's request_id field ("" when absent).
	BodyRequestID string
	// Thinking is false when the template was told not to think
	// (chat_template_kwargs.enable_thinking false, or reasoning_effort
	// "none"), so the model emits no reasoning.
	Thinking bool
	// Raw holds the body's top-level keys as sent (the last of duplicate
	// keys), for the render endpoints, which echo sampling fields the
	// simulator does not model.
	Raw map[string]json.RawMessage
}

// chatBody is the chat completions body, prompt-shaping fields included.
type chatBody struct {
	Messages             []message
	Tools                json.RawMessage
	ChatTemplate         *string
	ChatTemplateKwargs   json.RawMessage
	AddGenerationPrompt  bool
	ContinueFinalMessage bool
	AddSpecialTokens     bool
	Documents            json.RawMessage
	ReasoningEffort      json.RawMessage
}

type message struct {
	Role       string
	Content    json.RawMessage
	ToolCalls  json.RawMessage
	ToolCallID string
	Name       string
	// hasReasoning marks an assistant message carrying reasoning (a
	// Responses reasoning item, an Anthropic thinking block), which the
	// template drops from past turns.
	hasReasoning bool
}

// errBadRequest marks errors answered with 400.
var errBadRequest = errors.New("sim: bad request")

func badRequest(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errBadRequest}, a...)...)
}

// ParseRequest parses and renders a request body for path with the default
// configuration's template.
func ParseRequest(path string, body []byte) (*Request, error) {
	c := DefaultConfig()
	return c.ParseRequest(path, body)
}

// ParseRequest parses and renders a request body for path as an engine
// with configuration c does (its template and reasoning settings). path is
// PathChat, PathCompletions, PathResponses, PathMessages or PathCountTokens
// (a Messages body without max_tokens); Responses and Messages bodies are
// converted to chat messages and rendered by the chat template as vLLM
// does (see parseResponses and parseMessages).
//
// Parsing follows vLLM's pydantic request models in lax mode: keys are
// case-sensitive and unknown keys are ignored, the last of duplicate keys
// wins, booleans accept true/false, 0/1 and the strings "true"/"false",
// "1"/"0", "yes"/"no", "on"/"off", "t"/"f", "y"/"n" (any case), and integers
// accept 5, 5.0 and "5" (not 5.5).
func (c *Config) ParseRequest(path string, body []byte) (*Request, error) {
	m, err := decodeObject(body)
	if err != nil {
		return nil, err
	}
	var req *Request
	switch path {
	case PathChat:
		req, err = c.parseChat(m)
	case PathCompletions:
		req, err = parseCompletion(m)
	case PathResponses:
		req, err = c.parseResponses(m)
	case PathMessages:
		req, err = c.parseMessages(m, false)
	case PathCountTokens:
		req, err = c.parseMessages(m, true)
	default:
		return nil, badRequest("unknown path %q", path)
	}
	if err != nil {
		return nil, err
	}
	req.Raw = m
	return req, nil
}

func (e *Engine) parse(path string, body []byte) (*Request, error) {
	return e.cfg.ParseRequest(path, body)
}

// decodeObject decodes a JSON object into its raw members, keeping the last
// of duplicate keys and the keys' exact case.
func decodeObject(body []byte) (map[string]json.RawMessage, error) {
	var m map[string]json.RawMessage
	if err := json.Unmarshal(body, &m); err != nil {
		return nil, badRequest("invalid JSON body: %v", err)
	}
	if m == nil {
		return nil, badRequest("the body must be a JSON object")
	}
	return m, nil
}

func (c *Config) parseChat(m map[string]json.RawMessage) (*Request, error) {
	b, err := parseChatBody(m)
	if err != nil {
		return nil, err
	}
	prompt, err := c.renderChat(b)
	if err != nil {
		return nil, err
	}
	req, err := fillCommon(PathChat, m, prompt)
	if err != nil {
		return nil, err
	}
	mct, ok, err := laxIntPtr(m, "max_completion_tokens")
	if err != nil {
		return nil, err
	}
	if ok {
		if mct < 1 {
			return nil, badRequest("max_completion_tokens: must be at least 1, got %d", mct)
		}
		req.MaxTokens = mct
	}
	req.Thinking = c.thinking(b)
	if err := req.readTools(PathChat, m["tool_choice"], b.Tools); err != nil {
		return nil, err
	}
	if err := req.parseChatLogprobs(m); err != nil {
		return nil, err
	}
	return req, nil
}

// readTools sets the request's tools and tool choice from the chat-shaped
// tools its API's body converts to.
func (r *Request) readTools(path string, choice, tools json.RawMessage) error {
	r.Tools = toolList(tools)
	var err error
	r.ToolChoice, r.ToolName, err = toolChoice(path, choice, tools, r.Tools)
	return err
}

// namedToolChoice returns the function a chat tool_choice names, checked
// as vLLM's request validation does: tools must be given and hold it.
// Other choices ("auto", "none", "required", other shapes) give "".
func namedToolChoice(choice, tools json.RawMessage) (string, error) {
	var named struct {
		Type     string `json:"type"`
		Function *struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if !present(choice) || choice[0] != '{' || json.Unmarshal(choice, &named) != nil || named.Type != "function" || named.Function == nil {
		return "", nil
	}
	var list []struct {
		Function struct {
			Name string `json:"name"`
		} `json:"function"`
	}
	if !present(tools) {
		return "", badRequest("When using `tool_choice`, `tools` must be set.")
	}
	if err := json.Unmarshal(tools, &list); err != nil {
		return "", badRequest("tools: must be a list")
	}
	for _, t := range list {
		if t.Function.Name == named.Function.Name {
			return named.Function.Name, nil
		}
	}
	return "", badRequest("The tool specified in `tool_choice` does not match any of the specified `tools`")
}

// parseChatBody reads the prompt-shaping fields of a chat body.
func parseChatBody(m map[string]json.RawMessage) (*chatBody, error) {
	b := &chatBody{Tools: m["tools"], ChatTemplateKwargs: m["chat_template_kwargs"],
		Documents: m["documents"], ReasoningEffort: m["reasoning_effort"]}
	raw, ok := m["messages"]
	if !ok || !present(raw) {
		return nil, badRequest("messages: field required")
	}
	var msgs []json.RawMessage
	if err := json.Unmarshal(raw, &msgs); err != nil {
		return nil, badRequest("messages: must be a list")
	}
	if len(msgs) == 0 {
		return nil, badRequest("messages: field required")
	}
	for i, rm := range msgs {
		mm, err := decodeObject(rm)
		if err != nil {
			return nil, badRequest("messages[%d]: must be an object", i)
		}
		var msg message
		if err := laxString(mm, "role", &msg.Role); err != nil {
			return nil, badRequest("messages[%d].%v", i, err)
		}
		_ = laxString(mm, "tool_call_id", &msg.ToolCallID)
		_ = laxString(mm, "name", &msg.Name)
		msg.Content, msg.ToolCalls = mm["content"], mm["tool_calls"]
		b.Messages = append(b.Messages, msg)
	}
	if v, ok := m["chat_template"]; ok && present(v) {
		var s string
		if err := json.Unmarshal(v, &s); err != nil {
			return nil, badRequest("chat_template: must be a string")
		}
		b.ChatTemplate = &s
	}
	var err error
	if b.AddGenerationPrompt, err = laxBool(m, "add_generation_prompt", true); err != nil {
		return nil, err
	}
	if b.ContinueFinalMessage, err = laxBool(m, "continue_final_message", false); err != nil {
		return nil, err
	}
	if b.AddSpecialTokens, err = laxBool(m, "add_special_tokens", false); err != nil {
		return nil, err
	}
	if present(b.ChatTemplateKwargs) {
		var kw map[string]json.RawMessage
		if err := json.Unmarshal(b.ChatTemplateKwargs, &kw); err != nil {
			return nil, badRequest("chat_template_kwargs: must be an object")
		}
	}
	return b, nil
}

func parseCompletion(m map[string]json.RawMessage) (*Request, error) {
	prompt, err := completionPrompt(m["prompt"])
	if err != nil {
		return nil, err
	}
	req, err := fillCommon(PathCompletions, m, prompt)
	if err != nil {
		return nil, err
	}
	req.Thinking = true
	if err := req.parseCompletionLogprobs(m); err != nil {
		return nil, err
	}
	return req, nil
}

func completionPrompt(raw json.RawMessage) ([]Token, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, badRequest("prompt: field required")
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return Tokenize(s), nil
	}
	var strs []string
	if json.Unmarshal(raw, &strs) == nil {
		if len(strs) != 1 {
			return nil, badRequest("prompt: the simulator serves exactly one prompt per request")
		}
		return Tokenize(strs[0]), nil
	}
	var idsIn []int64
	if json.Unmarshal(raw, &idsIn) == nil {
		out := make([]Token, len(idsIn))
		for i, id := range idsIn {
			if id < 0 || id > 1<<32-1 {
				return nil, badRequest("prompt: token id %d out of range", id)
			}
			out[i] = tokenOfID(uint32(id))
		}
		return out, nil
	}
	return nil, badRequest("prompt: must be a string, a list of one string or a list of token ids")
}

func fillCommon(path string, m map[string]json.RawMessage, prompt []Token) (*Request, error) {
	req := &Request{Path: path, N: 1}
	var err error
	if v, ok := m["model"]; ok && present(v) {
		if err := json.Unmarshal(v, &req.Model); err != nil {
			return nil, badRequest("model: must be a string")
		}
	}
	if v, ok := m["request_id"]; ok && present(v) {
		if err := json.Unmarshal(v, &req.BodyRequestID); err != nil {
			return nil, badRequest("request_id: must be a string")
		}
	}
	if req.Stream, err = laxBool(m, "stream", false); err != nil {
		return nil, err
	}
	if req.IgnoreEOS, err = laxBool(m, "ignore_eos", false); err != nil {
		return nil, err
	}
	if req.ReturnTokenIDs, err = laxBool(m, "return_token_ids", false); err != nil {
		return nil, err
	}
	if _, err = laxBool(m, "echo", false); err != nil {
		return nil, err
	}
	if req.MinTokens, err = laxInt(m, "min_tokens", 0); err != nil {
		return nil, err
	}
	if v, ok := m["stream_options"]; ok && present(v) {
		if !req.Stream {
			return nil, badRequest("stream_options: only allowed when stream is true")
		}
		so, err := decodeObject(v)
		if err != nil {
			return nil, badRequest("stream_options: must be an object")
		}
		if req.IncludeUsage, err = laxBool(so, "include_usage", false); err != nil {
			return nil, err
		}
	}
	mt, ok, err := laxIntPtr(m, "max_tokens")
	if err != nil {
		return nil, err
	}
	if ok {
		if mt < 1 {
			return nil, badRequest("max_tokens: must be at least 1, got %d", mt)
		}
		req.MaxTokens = mt
	}
	n, ok, err := laxIntPtr(m, "n")
	if err != nil {
		return nil, err
	}
	if ok {
		if n < 1 {
			return nil, badRequest("n: must be at least 1")
		}
		req.N = n
	}
	if req.Stop, err = parseStop(m["stop"]); err != nil {
		return nil, err
	}
	truncate, ok, err := laxIntPtr(m, "truncate_prompt_tokens")
	if err != nil {
		return nil, err
	}
	if ok && truncate >= 1 && truncate < len(prompt) {
		prompt = prompt[len(prompt)-truncate:]
	}
	if len(prompt) == 0 {
		return nil, badRequest("prompt is empty")
	}
	req.Prompt = prompt
	if kv := bytes.TrimSpace(m["kv_transfer_params"]); present(kv) {
		req.KVParams = kv
	}
	return req, nil
}

func parseStop(raw json.RawMessage) ([]string, error) {
	raw = bytes.TrimSpace(raw)
	if len(raw) == 0 || bytes.Equal(raw, []byte("null")) {
		return nil, nil
	}
	var s string
	if json.Unmarshal(raw, &s) == nil {
		return []string{s}, nil
	}
	var ss []string
	if json.Unmarshal(raw, &ss) == nil {
		return ss, nil
	}
	return nil, badRequest("stop: must be a string or a list of strings")
}
