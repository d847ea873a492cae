package kvroute

import (
	"encoding/json"
	"net/http"
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// PathMessages is Anthropic's Messages API, as vLLM serves it (clients may
// add a query string such as ?beta=true).
const PathMessages = "/v1/messages"

// messagesAPI is POST /v1/messages. vLLM accepts kv_transfer_params on the
// request and returns it at the top level of a non-streaming message; its
// streams carry none, so streaming turns are not retained (StoreRefusal
// no_stream_handle; no warning, as no engine can do better). It returns no token ids: token verification
// fingerprints each turn's rendered prompt (POST /v1/messages/render).
// Errors use Anthropic's shape.
var messagesAPI = &api{
	code:        4,
	kind:        twoLegs,
	path:        PathMessages,
	below:       true,
	prefillSet:  messagesPrefillSet,
	prefillDrop: messagesPrefillDrop,
	render:      PathMessages + "/render",
	nested:      "message",
	final:       messagesFinal,
	// vLLM's Messages streams carry no handle, with or without PR #40186.
	streamHandles: false,
	head:          "system",
	turns:         "messages",
	errors:        anthropicErrors{},
	impl:          messages{},
}

type messages struct{}

func (messages) validate(obj jsonraw.Object) error {
	if err := objectArray(obj, "messages"); err != nil {
		return err
	}
	if v, ok := obj.Get("max_tokens"); !ok || jsonraw.IsNull(v) {
		return badRequest("max_tokens is required")
	}
	return nil
}

var messagesPrefillSet = []jsonraw.Member{
	{Key: "stream", Value: jsonFalse},
	{Key: "max_tokens", Value: jsonOne},
}

// stop_sequences go too: P must finish on its length cap.
var messagesPrefillDrop = append(append([]string(nil), commonPrefillDrop...), "stop_sequences")

// bodyReply reads a message: its text blocks, whether it thought, its
// tool uses, and its stop reason in chat's terms (vLLM's stop_reason_map
// read back: max_tokens is a length cap, tool_use chat's tool_calls,
// end_turn and stop_sequence a stop).
func (messages) bodyReply(obj jsonraw.Object) *Reply {
	rep := &Reply{}
	if v, ok := obj.Get("stop_reason"); ok {
		switch s, _ := jsonraw.String(v); s {
		case "max_tokens":
			rep.FinishReason = "length"
		case "tool_use":
			rep.FinishReason = "tool_calls"
		case "end_turn", "stop_sequence":
			rep.FinishReason = "stop"
		default:
			rep.FinishReason = s
		}
	}
	content, ok := obj.Get("content")
	if !ok || len(content) == 0 || content[0] != '[' {
		rep.Incomplete = true
		return rep
	}
	var calls []byte
	_ = jsonraw.Elements(content, func(b []byte) error {
		typ := ""
		if v, ok := jsonraw.Lookup(b, "type"); ok {
			typ, _ = jsonraw.String(v)
		}
		switch typ {
		case "text":
			if v, ok := jsonraw.Lookup(b, "text"); ok {
				s, _ := jsonraw.String(v)
				rep.Content += s
			}
		case "thinking", "redacted_thinking":
			rep.Reasoning = "thinking"
		case "tool_use":
			if calls == nil {
				calls = []byte{'['}
			} else {
				calls = append(calls, ',')
			}
			calls = append(calls, b...)
		}
		return nil
	})
	if calls != nil {
		rep.ToolCalls = append(calls, ']')
	}
	return rep
}

// billingHeader starts the text block Claude Code puts in its system
// prompt (an attribution line with a hash that changes every request).
const billingHeader = "x-anthropic-billing-header"

// renders is vLLM's rule (vllm/entrypoints/anthropic/serving.py,
// _convert_system_message, and inline_system.py, system_text): text
// blocks of the system prompt and of system-role messages are rendered
// only when not empty and not starting with x-anthropic-billing-header; a
// system message's content string is dropped when it starts so; a
// top-level system string is rendered as it is.
func (messages) renders(text, role string, head, inBlock bool) bool {
	switch {
	case !head && role != "system":
		return true
	case inBlock:
		return text != "" && !strings.HasPrefix(text, billingHeader)
	case head:
		return true
	}
	return !strings.HasPrefix(text, billingHeader)
}

// The event type that ends a Messages stream.
var messagesFinal = map[string]bool{"message_stop": true}

type anthropicError struct {
	Type  string               `json:"type"`
	Error anthropicErrorDetail `json:"error"`
}

type anthropicErrorDetail struct {
	Type    string `json:"type"`
	Message string `json:"message"`
}

// anthropicErrors are Anthropic's errors: {"type":"error","error":{"type",
// "message"}}, with the error type Anthropic's API gives the status (its
// SDKs read error.type and error.message), and the same as an event:
// error.
type anthropicErrors struct{}

func (anthropicErrors) name() string       { return "anthropic" }
func (anthropicErrors) streamName() string { return "anthropic" }

func (anthropicErrors) body(status int, err error) []byte {
	typ := "api_error"
	switch {
	case status == http.StatusUnauthorized:
		typ = "authentication_error"
	case status == http.StatusForbidden:
		typ = "permission_error"
	case status == http.StatusNotFound:
		typ = "not_found_error"
	case status == http.StatusRequestEntityTooLarge:
		typ = "request_too_large"
	case status == http.StatusTooManyRequests:
		typ = "rate_limit_error"
	case status == http.StatusServiceUnavailable:
		typ = "overloaded_error"
	case status == http.StatusGatewayTimeout:
		typ = "timeout_error"
	case status >= 400 && status < 500:
		typ = "invalid_request_error"
	}
	b, _ := json.Marshal(anthropicError{Type: "error", Error: anthropicErrorDetail{Type: typ, Message: clientMessage(err)}})
	return b
}

func (a anthropicErrors) event(status int, err error, _ int64) []byte {
	b := a.body(status, err)
	out := make([]byte, 0, len(b)+24)
	out = append(out, "event: error\ndata: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}
