package kvroute

import (
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
)

// api is everything the turn flow must know about one HTTP API: how a
// request is validated, how the prefill leg rewrites it, how a reply is
// read back from a body, how the prompt's tokens are obtained, and how
// errors are shaped. The turn flow calls it and never branches on the API;
// each API is one file (api_chat.go, api_completions.go).
type api interface {
	// path is the API's route.
	path() string
	// validate checks the parsed body of a request, returning errors that
	// wrap ErrBadRequest.
	validate(obj jsonraw.Object) error
	// prefillSet are the members the prefill leg sets (besides the
	// handle), prefillDrop those it removes: the leg must not stream and
	// must stop after one token whatever the client asked.
	prefillSet() []jsonraw.Member
	prefillDrop() []string
	// bodyReply reads what the decode engine produced from a
	// non-streaming answer, validated by jsonraw.Parse.
	bodyReply(obj jsonraw.Object) *Reply
	// renderPath is the engine's render route for the API ("" when it
	// has none), and whether its answer is a list of one object.
	renderPath() (path string, list bool)
	// tokenizeFields are the body members vLLM's /tokenize takes for the
	// API, nil when /tokenize cannot render it; tokenizable says whether
	// this request's prompt can be tokenized there at all.
	tokenizeFields() []string
	tokenizable(req *Request) bool
	// promptIDs returns the prompt's token ids when the request itself
	// gives them (a completions prompt of ids), ok false otherwise.
	promptIDs(req *Request) (ids []uint32, ok bool)
	// tokenIDs reports whether the decode engine returns token ids on this
	// API when asked (return_token_ids). Without them, token verification
	// fingerprints only the rendered prompt of each turn.
	tokenIDs() bool
	// newStream returns the capture of one decode stream; tokens asks it
	// to collect token ids, strip to remove them.
	newStream(tokens, strip bool) capture.Stream
	// streamHandles reports whether the API's streams can carry the
	// decode handle at all (with vLLM PR #40186).
	streamHandles() bool
	// conversation names the members that open a conversation (the
	// instructions or system prompt) and hold its turns, for the anchor of
	// APIs without content rules; "" for chat and completions, which
	// ContinuationKeys keys by content.
	conversation() (head, turns string)
	// renders reports whether the engine renders text, a content string
	// or (inBlock) a text block's text, of the conversation's head member
	// (head) or of a turn of the given role. The anchor keeps only what
	// the engine renders: vLLM drops some texts before rendering.
	renders(text, role string, head, inBlock bool) bool
	// errorBody is an error in the API's JSON shape; streamError the same
	// as the stream event the API's clients expect, after the event whose
	// sequence number (Responses) is seq-1.
	errorBody(status int, err error) []byte
	streamError(status int, err error, seq int64) []byte
}

// apiFor returns the API a Router serves at path.
func apiFor(path string) (api, bool) {
	switch path {
	case PathChatCompletions:
		return chatAPI{}, true
	case PathCompletions:
		return completionsAPI{}, true
	case PathResponses:
		return responsesAPI{}, true
	case PathMessages:
		return messagesAPI{}, true
	}
	return nil, false
}

// ErrorBody renders err as the JSON error body of the API served at path,
// for a response of the given status: Anthropic's {"type":"error","error":
// {"type","message"}} for PathMessages and the paths below it, OpenAI's
// {"error":{"message","type","code"}} otherwise. It is what the Router's
// http.Handler answers, for programs that answer in front of it (limits,
// authentication) in the same shapes.
func ErrorBody(path string, status int, err error) []byte {
	if path == PathMessages || strings.HasPrefix(path, PathMessages+"/") {
		return messagesAPI{}.errorBody(status, err)
	}
	return errorBody(status, err)
}

// StreamErrorEvent renders err as the SSE event that ends a broken stream
// of the API served at path, for a failure of the given status: OpenAI's
// error body as a data event (data: {"error":{...}}, as vLLM ends a failed
// chat or completions stream), Responses' error event (event: error with
// {"type":"error","code","message","param","sequence_number"}, seq being
// the sequence number after the last event sent), or Anthropic's (event:
// error with {"type":"error","error":{"type","message"}}) for PathMessages
// and the paths below it. It is what the Router's http.Handler writes,
// for programs that end streams themselves (a drain) in the same shapes.
func StreamErrorEvent(path string, status int, err error, seq int64) []byte {
	switch {
	case path == PathMessages || strings.HasPrefix(path, PathMessages+"/"):
		return messagesAPI{}.streamError(status, err, seq)
	case path == PathResponses:
		return responsesAPI{}.streamError(status, err, seq)
	}
	return sseError(status, err)
}

// openAI is what the OpenAI-shaped APIs share: errors, token ids and the
// chunk stream of chat and completions.
type openAI struct{}

func (openAI) errorBody(status int, err error) []byte { return errorBody(status, err) }
func (openAI) streamError(status int, err error, _ int64) []byte {
	return sseError(status, err)
}
func (openAI) tokenIDs() bool                          { return true }
func (openAI) streamHandles() bool                     { return true }
func (openAI) conversation() (string, string)          { return "", "" }
func (openAI) renders(string, string, bool, bool) bool { return true }
func (openAI) newStream(tokens, strip bool) capture.Stream {
	if tokens {
		return capture.NewChunks(capture.WithReply(), capture.WithTokenIDs(strip))
	}
	return capture.NewChunks(capture.WithReply())
}

// Members removed from the client's body on every prefill leg, besides
// those an API adds (kvroute package doc, "The turn", step 2): the
// client's kv_transfer_params (always replaced), the router's own
// conversation_id, stream options, length floors and caps that would keep
// P from stopping after one token, and stop and stop_token_ids: older
// engines emit P's handle only when P stopped on its length cap, so a stop
// string or an EOS as P's one token would leave the turn without one
// (ignore_eos is set for the same reason). None of them shapes the prompt;
// the decode leg keeps them.
var commonPrefillDrop = []string{kvKey, "stream_options", "conversation_id", "stop", "stop_token_ids"}

// oneTokenLeg is the prefill rewrite of the OpenAI APIs: no stream, one
// token, EOS ignored.
var oneTokenLeg = []jsonraw.Member{
	{Key: "stream", Value: jsonFalse},
	{Key: "max_tokens", Value: jsonOne},
	{Key: "ignore_eos", Value: jsonTrue},
}

// openAIPrefillDrop adds the OpenAI length options to commonPrefillDrop.
var openAIPrefillDrop = append(append([]string(nil), commonPrefillDrop...), "max_completion_tokens", "min_tokens", "min_completion_tokens")

// choiceZero returns choice 0 of an OpenAI answer's choices, or nil.
func choiceZero(obj jsonraw.Object) []byte {
	choices, _ := obj.Get("choices")
	var c []byte
	_ = jsonraw.Elements(choices, func(v []byte) error { c = v; return errStop })
	if len(c) == 0 || c[0] != '{' {
		return nil
	}
	return c
}

// finishOf fills the finish and stop reasons of an OpenAI choice.
func finishOf(rep *Reply, c []byte) {
	if v, ok := jsonraw.Lookup(c, "finish_reason"); ok {
		rep.FinishReason, _ = jsonraw.String(v)
	}
	if v, ok := jsonraw.Lookup(c, "stop_reason"); ok {
		rep.StopReason = append([]byte(nil), v...)
	}
}

// pickMembers builds a JSON object of the request's members named in
// fields, in that order.
func pickMembers(req *Request, fields []string) []byte {
	set := make([]jsonraw.Member, 0, len(fields))
	for _, f := range fields {
		if v, ok := req.Field(f); ok {
			set = append(set, jsonraw.Member{Key: f, Value: v})
		}
	}
	return (jsonraw.Object{}).Edit(nil, set...)
}

// objectArray checks that member key is a non-empty array of objects.
func objectArray(obj jsonraw.Object, key string) error {
	v, ok := obj.Get(key)
	if !ok || len(v) == 0 || v[0] != '[' {
		return badRequest("%s must be a non-empty array", key)
	}
	n := 0
	if err := jsonraw.Elements(v, func(m []byte) error {
		if len(m) == 0 || m[0] != '{' {
			return badRequest("%s[%d] must be an object", key, n)
		}
		n++
		return nil
	}); err != nil {
		return err
	}
	if n == 0 {
		return badRequest("%s must be a non-empty array", key)
	}
	return nil
}

// choiceReply starts the reply of an OpenAI answer from its choice 0: the
// finish and stop reasons, and the choice itself (nil, with the reply
// marked incomplete, when there is none).
func choiceReply(obj jsonraw.Object) (*Reply, []byte) {
	rep := &Reply{}
	c := choiceZero(obj)
	if c == nil {
		rep.Incomplete = true
		return rep, nil
	}
	finishOf(rep, c)
	return rep, c
}
