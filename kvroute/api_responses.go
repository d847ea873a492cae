package kvroute

import (
	"encoding/json"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

// PathResponses is OpenAI's Responses API, as vLLM serves it.
const PathResponses = "/v1/responses"

// responsesAPI is POST /v1/responses. vLLM accepts kv_transfer_params on
// the request and returns it at the top level of the response object, in a
// stream inside the object that response.completed wraps. It returns no
// token ids, so token verification fingerprints each turn's rendered
// prompt (POST /v1/responses/render). Stateful features cannot span
// separate prefill and decode servers: previous_response_id and background
// are refused with 400, and the prefill leg never stores.
var responsesAPI = &api{
	code:          3,
	kind:          twoLegs,
	path:          PathResponses,
	prefillSet:    responsesPrefillSet,
	prefillDrop:   commonPrefillDrop,
	render:        PathResponses + "/render",
	nested:        "response",
	final:         responsesFinal,
	streamReply:   responsesStreamReply,
	streamHandles: true,
	head:          "instructions",
	turns:         "input",
	errors:        responsesErrors{},
	impl:          responses{},
}

type responses struct{}

func (responses) validate(obj jsonraw.Object) error {
	v, ok := obj.Get("input")
	if !ok || jsonraw.IsNull(v) || len(v) == 0 || (v[0] != '"' && v[0] != '[') {
		return badRequest("input must be a string or an array of input items")
	}
	if v, ok := obj.Get("previous_response_id"); ok && !jsonraw.IsNull(v) {
		return badRequest("previous_response_id needs the response store of one server, but prefill and decode run on different servers: send the whole input every turn (store: false)")
	}
	if v, ok := obj.Get("background"); ok {
		if b, _ := lenientBool(v); b {
			return badRequest("background responses are not supported through a prefill/decode router")
		}
	}
	// The response object echoes the request (metadata, tools, text,
	// ...): a member there named as a KV handle or its members would make
	// every answer fail closed, so it is refused here, before any engine
	// is asked. The top-level kv_transfer_params is always replaced.
	for i := range obj.Len() {
		if key, v := obj.Member(i); key != kvKey && sse.NamesHandleMember(v) {
			return badRequest("%s holds a member whose name is reserved for KV handles (their key, or remote_block_ids, remote_engine_id, remote_request_id, remote_num_tokens, remote_blocks_expiry_time, do_remote_decode, do_remote_prefill): the response would echo it", key)
		}
	}
	return nil
}

var responsesPrefillSet = []jsonraw.Member{
	{Key: "stream", Value: jsonFalse},
	{Key: "max_output_tokens", Value: jsonOne},
	{Key: "store", Value: jsonFalse},
}

// bodyReply reads a response object: the text of its message items,
// whether it has reasoning items, its function calls, and its status
// (completed is a stop, incomplete for max_output_tokens a length cap).
func (responses) bodyReply(obj jsonraw.Object) *Reply { return responseReply(obj.Bytes()) }

func responseReply(resp []byte) *Reply {
	rep := &Reply{}
	status := ""
	if v, ok := jsonraw.Lookup(resp, "status"); ok {
		status, _ = jsonraw.String(v)
	}
	switch status {
	case "completed":
		rep.FinishReason = "stop"
	case "incomplete":
		rep.FinishReason = status
		if d, ok := jsonraw.Lookup(resp, "incomplete_details"); ok && len(d) > 0 && d[0] == '{' {
			if r, ok := jsonraw.Lookup(d, "reason"); ok {
				if s, _ := jsonraw.String(r); s == "max_output_tokens" {
					rep.FinishReason = "length"
				}
			}
		}
	default:
		rep.FinishReason = status
	}
	output, ok := jsonraw.Lookup(resp, "output")
	if !ok || len(output) == 0 || output[0] != '[' {
		rep.Incomplete = true
		return rep
	}
	var calls []byte
	_ = jsonraw.Elements(output, func(item []byte) error {
		typ := ""
		if v, ok := jsonraw.Lookup(item, "type"); ok {
			typ, _ = jsonraw.String(v)
		}
		switch typ {
		case "message":
			parts, _ := jsonraw.Lookup(item, "content")
			_ = jsonraw.Elements(parts, func(p []byte) error {
				if v, ok := jsonraw.Lookup(p, "text"); ok {
					s, _ := jsonraw.String(v)
					rep.Content += s
				}
				return nil
			})
		case "reasoning":
			rep.Reasoning = "reasoning"
		case "function_call":
			if calls == nil {
				calls = []byte{'['}
			} else {
				calls = append(calls, ',')
			}
			calls = append(calls, item...)
		}
		return nil
	})
	if calls != nil {
		rep.ToolCalls = append(calls, ']')
	}
	return rep
}

// The event types that end a Responses stream.
var responsesFinal = map[string]bool{"response.completed": true, "response.incomplete": true, "response.failed": true}

// responsesStreamReply reads the reply from a final event's data: the
// response object it wraps.
func responsesStreamReply(data []byte) *Reply {
	resp, ok := jsonraw.Lookup(data, "response")
	if !ok {
		return &Reply{Incomplete: true}
	}
	return responseReply(resp)
}

// responsesErrorEvent is the Responses API's stream error event
// (ResponseErrorEvent in OpenAI's SDKs): code and message at the top
// level, param null.
type responsesErrorEvent struct {
	Type           string  `json:"type"`
	Code           string  `json:"code"`
	Message        string  `json:"message"`
	Param          *string `json:"param"`
	SequenceNumber int64   `json:"sequence_number"`
}

// responsesErrors are the Responses API's errors: OpenAI's body, and its
// own error event: event: error, whose data OpenAI's SDKs read as a
// ResponseErrorEvent and Codex as a failed stream ("Error Code {code}:
// {message}"). seq follows the last event's sequence_number.
type responsesErrors struct{ openAIErrors }

func (responsesErrors) streamName() string { return "responses" }

func (responsesErrors) event(status int, err error, seq int64) []byte {
	_, code := errorKind(status, err)
	b, _ := json.Marshal(responsesErrorEvent{Type: "error", Code: code, Message: clientMessage(err), SequenceNumber: seq})
	out := make([]byte, 0, len(b)+24)
	out = append(out, "event: error\ndata: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}
