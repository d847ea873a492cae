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
}

// chatBody is the chat completions body, prompt-shaping fields included.
type chatBody struct {
	Model                string          `json:"model"`
	Messages             []message       `json:"messages"`
	Tools                json.RawMessage `json:"tools"`
	ChatTemplate         *string         `json:"chat_template"`
	ChatTemplateKwargs   json.RawMessage `json:"chat_template_kwargs"`
	AddGenerationPrompt  *bool           `json:"add_generation_prompt"`
	ContinueFinalMessage bool            `json:"continue_final_message"`
	AddSpecialTokens     bool            `json:"add_special_tokens"`
	Documents            json.RawMessage `json:"documents"`
	ReasoningEffort      json.RawMessage `json:"reasoning_effort"`
	MaxCompletionTokens  *int            `json:"max_completion_tokens"`
	TruncatePromptTokens *int            `json:"truncate_prompt_tokens"`
	common
}

type completionBody struct {
	Model                string          `json:"model"`
	Prompt               json.RawMessage `json:"prompt"`
	TruncatePromptTokens *int            `json:"truncate_prompt_tokens"`
	common
}

type common struct {
	Stream        bool            `json:"stream"`
	StreamOptions *streamOptions  `json:"stream_options"`
	MaxTokens     *int            `json:"max_tokens"`
	MinTokens     int             `json:"min_tokens"`
	IgnoreEOS     bool            `json:"ignore_eos"`
	N             *int            `json:"n"`
	Stop          json.RawMessage `json:"stop"`
	KVParams      json.RawMessage `json:"kv_transfer_params"`
}

type streamOptions struct {
	IncludeUsage bool `json:"include_usage"`
}

type message struct {
	Role             string          `json:"role"`
	Content          json.RawMessage `json:"content"`
	ReasoningContent json.RawMessage `json:"reasoning_content"`
	ToolCalls        json.RawMessage `json:"tool_calls"`
	ToolCallID       string          `json:"tool_call_id"`
	Name             string          `json:"name"`
}

// errBadRequest marks errors answered with 400.
var errBadRequest = errors.New("sim: bad request")

func badRequest(format string, a ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{errBadRequest}, a...)...)
}

// ParseRequest parses and renders a request body for path.
func ParseRequest(path string, body []byte) (*Request, error) {
	switch path {
	case PathChat:
		return parseChat(body)
	case PathCompletions:
		return parseCompletion(body)
	default:
		return nil, badRequest("unknown path %q", path)
	}
}

func parseChat(body []byte) (*Request, error) {
	var b chatBody
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, badRequest("invalid JSON body: %v", err)
	}
	if len(b.Messages) == 0 {
		return nil, badRequest("messages: field required")
	}
	prompt, err := renderChat(&b)
	if err != nil {
		return nil, err
	}
	req, err := fillCommon(PathChat, b.Model, &b.common, b.TruncatePromptTokens, prompt)
	if err != nil {
		return nil, err
	}
	if b.MaxCompletionTokens != nil {
		req.MaxTokens = *b.MaxCompletionTokens
	}
	return req, nil
}

func parseCompletion(body []byte) (*Request, error) {
	var b completionBody
	if err := json.Unmarshal(body, &b); err != nil {
		return nil, badRequest("invalid JSON body: %v", err)
	}
	prompt, err := completionPrompt(b.Prompt)
	if err != nil {
		return nil, err
	}
	return fillCommon(PathCompletions, b.Model, &b.common, b.TruncatePromptTokens, prompt)
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
			out[i] = Token{ID: uint32(id), Text: fmt.Sprintf("<%d>", id)}
		}
		return out, nil
	}
	return nil, badRequest("prompt: must be a string, a list of one string or a list of token ids")
}

func fillCommon(path, model string, c *common, truncate *int, prompt []Token) (*Request, error) {
	req := &Request{Path: path, Model: model, Stream: c.Stream, MinTokens: c.MinTokens, IgnoreEOS: c.IgnoreEOS, N: 1}
	if c.StreamOptions != nil {
		if !c.Stream {
			return nil, badRequest("stream_options: only allowed when stream is true")
		}
		req.IncludeUsage = c.StreamOptions.IncludeUsage
	}
	if c.MaxTokens != nil {
		if *c.MaxTokens < 1 {
			return nil, badRequest("max_tokens: must be at least 1, got %d", *c.MaxTokens)
		}
		req.MaxTokens = *c.MaxTokens
	}
	if c.N != nil {
		if *c.N < 1 {
			return nil, badRequest("n: must be at least 1")
		}
		req.N = *c.N
	}
	stop, err := parseStop(c.Stop)
	if err != nil {
		return nil, err
	}
	req.Stop = stop
	if truncate != nil && *truncate >= 1 && *truncate < len(prompt) {
		prompt = prompt[len(prompt)-*truncate:]
	}
	if len(prompt) == 0 {
		return nil, badRequest("prompt is empty")
	}
	req.Prompt = prompt
	kv := bytes.TrimSpace(c.KVParams)
	if len(kv) > 0 && !bytes.Equal(kv, []byte("null")) {
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
