package kvroute

import (
	"context"
	"math"
	"strconv"
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
)

// api describes one HTTP API a Router serves: a file per API (api_*.go)
// and one entry in apis. It is a contributor-only seam: unexported, so
// only a change to kvroute adds an API (ARCHITECTURE.md, Extension
// points); a program in front of the Router sees the APIs through APIs.
// The turn reads the descriptor and never branches on the API, only on
// its kind. What every API does differently is behaviour of its impl
// (validation, reading a reply from a body); what only some have are small
// optional interfaces of the impl: tokenizer (vLLM's /tokenize renders
// it), promptIDer (a prompt given as token ids), renderFilter (texts the
// engine drops before rendering).
type api struct {
	// code is the API's persisted code: every retained entry keeps the
	// code of the API its turn was served on (entry.Entry.API), in the
	// Store, Redis included, and a release request reads it back. It is
	// never renumbered nor reused: TestAPICodes pins the codes given.
	code byte
	// kind is twoLegs (a prefill and a decode leg, the handle retained)
	// or passThrough (one leg to a decode engine: the members below
	// about legs, handles and conversations are then unused).
	kind apiKind
	path string
	// below: the paths below path take its error shape (Anthropic's
	// count_tokens).
	below bool
	// prefillSet are the members the prefill leg sets (besides the
	// handle), prefillDrop those it removes: the leg must not stream and
	// must stop after one token whatever the client asked.
	prefillSet  []jsonraw.Member
	prefillDrop []string
	// render is the engine's render route ("" when it has none);
	// renderList says its answer is a list of one object.
	render     string
	renderList bool
	// tokenIDs: the decode engine returns token ids on this API when
	// asked (return_token_ids). Without them, token verification
	// fingerprints only the rendered prompt of each turn.
	tokenIDs bool
	// Where the decode handle sits in a stream: a chat or completions
	// stream (nested "") carries it at the top level of its final chunk
	// and ends with data: [DONE]; the named events of the other APIs carry
	// it at the top level or in the object member nested, and the stream
	// ends with one of the final event types, whose data streamReply reads
	// the reply from. streamHandles says its streams can carry a handle at
	// all (with vLLM PR #40186). In a body it sits at the top level.
	nested        string
	final         map[string]bool
	streamReply   func(data []byte) *Reply
	streamHandles bool
	// head and turns name the members that open a conversation (the
	// instructions or system prompt) and hold its turns, for the anchor of
	// APIs without content rules; "" for chat and completions, which
	// ContinuationKeys keys by content.
	head, turns string
	errors      errorShape
	impl        apiImpl
}

// apiKind is how a Router serves an API.
type apiKind uint8

const (
	// twoLegs is a generation API: a prefill leg on a prefill engine, a
	// decode leg with its handle on a decode engine, and the decode
	// engine's handle retained for the next turn (Do).
	twoLegs apiKind = iota + 1
	// passThrough is an API forwarded as it is (forward): one leg, the
	// client's body less kv_transfer_params and conversation_id, to a
	// decode engine the Selector picks; no prefill, no handle, nothing
	// retained. Its answer reaches the client as every answer does
	// (Response: headers and body scrubbed of handles), and its turn is
	// recorded with Reuse ReuseOff and the decode engine that answered.
	// Its impl embeds forwarded. /v1/embeddings would be one
	// (extend_passthrough_test.go).
	passThrough
)

// apiImpl is what every API does its own way.
type apiImpl interface {
	// validate checks the parsed body of a request, returning errors that
	// wrap ErrBadRequest.
	validate(obj jsonraw.Object) error
	// bodyReply reads what the decode engine produced from a
	// non-streaming answer, validated by jsonraw.Parse.
	bodyReply(obj jsonraw.Object) *Reply
}

// forwarded is the part of apiImpl a pass-through API's impl embeds: the
// router reads no reply from its answers.
type forwarded struct{}

func (forwarded) bodyReply(jsonraw.Object) *Reply { return &Reply{} }

// forward runs the turn of a pass-through API: its one leg goes to a
// decode engine as a decode leg without a handle does (decode: the
// Selector picks the engine, a leg that failed before anything reached the
// client goes to another one), and the engine's answer is the turn's.
func forward(ctx context.Context, rt *retainer) (*Response, error) {
	rt.t.rec.Reuse = ReuseOff
	rt.local = true // no prefill leg: no handle is expected
	resp, err := decode(ctx, rt.t, prefilled{reuse: ReuseOff}, "", &rt.tries)
	if err != nil {
		return nil, rt.end(PhaseDecode, err)
	}
	return resp.to(rt), nil
}

// tokenizer is an API whose prompts vLLM's /tokenize can render: the body
// members /tokenize takes for it, and whether this request's prompt can
// be tokenized there at all.
type tokenizer interface {
	tokenizeFields() []string
	tokenizable(req *Request) bool
}

// promptIDer is an API whose request may give its prompt's token ids
// itself (a completions prompt of ids).
type promptIDer interface {
	promptIDs(req *Request) (ids []uint32, ok bool)
}

// renderFilter is an API whose engine leaves texts out of the rendered
// prompt: renders reports whether it renders text, a content string or
// (inBlock) a text block's text, of the conversation's head member (head)
// or of a turn of the given role. The anchor keeps only what the engine
// renders.
type renderFilter interface {
	renders(text, role string, head, inBlock bool) bool
}

// apis is the registry: the APIs a Router serves, which drive its routing
// (ServeHTTP), its error shapes (ErrorBody, Response.ErrorEvent) and a front
// end's route table (APIs). Its order is the order APIs lists them in;
// what is persisted is each API's code, never its place here.
var apis = []*api{chatAPI, completionsAPI, responsesAPI, messagesAPI}

// apiCode is the code an entry keeps of the API its turn was served on
// (api.code; 0: unknown).
func apiCode(path string) byte {
	if a, ok := apiFor(path); ok {
		return a.code
	}
	return 0
}

// apiFor returns the API a Router serves at path.
func apiFor(path string) (*api, bool) {
	for _, a := range apis {
		if a.path == path {
			return a, true
		}
	}
	return nil, false
}

// shapeFor returns the error shape of path: its API's, or the API's whose
// paths below its own take its shape; OpenAI's otherwise.
func shapeFor(path string) errorShape {
	for _, a := range apis {
		if a.path == path || (a.below && strings.HasPrefix(path, a.path+"/")) {
			return a.errors
		}
	}
	return openAIErrors{}
}

// newStream returns the capture of one decode stream of the API; tokens
// asks it to collect token ids, strip to remove them.
func (a *api) newStream(tokens, strip bool) capture.Stream {
	if a.nested != "" {
		return capture.NewTyped(a.nested, a.final, a.streamReply)
	}
	if tokens {
		return capture.NewChunks(capture.WithReply(), capture.WithTokenIDs(strip))
	}
	return capture.NewChunks(capture.WithReply())
}

// renders reports whether the API's engine renders a text (renderFilter;
// without one, every text).
func (a *api) renders(text, role string, head, inBlock bool) bool {
	f, ok := a.impl.(renderFilter)
	return !ok || f.renders(text, role, head, inBlock)
}

// API is one HTTP API of a Router, as a front end in front of it sees it:
// where to route it and how to shape the errors it answers itself.
type API struct {
	// Path is the API's route: ServeHTTP serves POST there.
	Path string
	// ErrorShape is the JSON shape of its errors (ErrorBody): "openai"
	// ({"error":{"message","type","param","code"}}) or "anthropic"
	// ({"type":"error","error":{"type","message"}}), on Path and, for
	// Anthropic's API, on the paths below it.
	ErrorShape string
	// StreamErrorShape is the event that ends its broken streams
	// (Response.ErrorEvent): "data" (OpenAI's error body as a data event, as
	// vLLM ends a failed chat or completions stream), "responses" (event:
	// error, a ResponseErrorEvent numbered after the last event sent) or
	// "anthropic" (event: error with Anthropic's body).
	StreamErrorShape string
}

// APIs returns the APIs a Router serves, in the order it lists them: a
// front end routes their paths to it (examples/proxy builds its route
// table from them).
func APIs() []API {
	out := make([]API, len(apis))
	for i, a := range apis {
		out[i] = API{Path: a.path, ErrorShape: a.errors.name(), StreamErrorShape: a.errors.streamName()}
	}
	return out
}

// ErrorBody renders err as the JSON error body of the API served at path,
// for a response of the given status: Anthropic's {"type":"error","error":
// {"type","message"}} for PathMessages and the paths below it, OpenAI's
// {"error":{"message","type","code"}} otherwise. It is what the Router's
// http.Handler answers, for programs that answer in front of it (limits,
// authentication) in the same shapes.
func ErrorBody(path string, status int, err error) []byte {
	return shapeFor(path).body(status, err)
}

// errorShape writes an API's errors: as a JSON body, and as the stream
// event that ends a broken stream after the event whose sequence number
// (Responses) is seq-1.
type errorShape interface {
	body(status int, err error) []byte
	event(status int, err error, seq int64) []byte
	name() string       // API.ErrorShape
	streamName() string // API.StreamErrorShape
}

// openAIErrors are the errors of the OpenAI-shaped APIs: a body, and the
// same body as a data event, as vLLM ends a failed stream.
type openAIErrors struct{}

func (openAIErrors) body(status int, err error) []byte { return errorBody(status, err) }
func (openAIErrors) event(status int, err error, _ int64) []byte {
	return sseError(status, err)
}
func (openAIErrors) name() string       { return "openai" }
func (openAIErrors) streamName() string { return "data" }

// sseError frames an error as the SSE event vLLM itself sends when a
// stream fails.
func sseError(status int, err error) []byte {
	b := errorBody(status, err)
	out := make([]byte, 0, len(b)+8)
	out = append(out, "data: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}

// Members removed from the client's body on every prefill leg, besides
// those an API adds (docs/kvroute.md, "The turn", step 2): the
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

// Request flags are read the way vLLM's request models read them: pydantic
// v2 in lax mode (pydantic-core's str_as_bool, int_as_bool, str_as_int and
// float_as_int), so that the router and the engine agree on what a request
// asks for. A value pydantic rejects is reported as not ok; callers decide
// whether that means a 400 or a refusal.

// lenientBool reads a JSON value as a pydantic v2 lax bool: true and false;
// the integers 0 and 1; a number with no fractional part equal to 0 or 1
// (0.0, 1.0, 1e0); and the strings "0" and "1" and, ignoring ASCII case,
// "f", "n", "no", "off", "false", "t", "y", "on", "yes", "true". Strings
// are not trimmed (" true" is rejected, as pydantic does). null and
// anything else are not ok.
func lenientBool(v []byte) (value, ok bool) {
	if b, ok := jsonraw.Bool(v); ok {
		return b, true
	}
	if len(v) == 0 {
		return false, false
	}
	if v[0] == '"' {
		s, ok := jsonraw.String(v)
		if !ok {
			return false, false
		}
		return strBool(s)
	}
	n, ok := numberInt(v)
	if !ok || (n != 0 && n != 1) {
		return false, false
	}
	return n == 1, true
}

// strBool is pydantic-core's str_as_bool.
func strBool(s string) (value, ok bool) {
	switch s {
	case "0":
		return false, true
	case "1":
		return true, true
	}
	for _, f := range [...]string{"f", "n", "no", "off", "false"} {
		if asciiEqualFold(s, f) {
			return false, true
		}
	}
	for _, t := range [...]string{"t", "y", "on", "yes", "true"} {
		if asciiEqualFold(s, t) {
			return true, true
		}
	}
	return false, false
}

// asciiEqualFold compares s with the lower-case ASCII word w, folding only
// ASCII letters (as Rust's eq_ignore_ascii_case: "yeſ" is not "yes").
func asciiEqualFold(s, w string) bool {
	if len(s) != len(w) {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != w[i] {
			return false
		}
	}
	return true
}

// lenientInt reads a JSON value as a pydantic v2 lax int: an integer; a
// number with no fractional part (5.0, 5e0); true and false (1 and 0); or
// a string holding an integer, with surrounding whitespace, a leading '+'
// or '-', leading zeros, single underscores between digits ("1_000") and a
// fraction of zeros ("5.00") allowed. Values outside int64 and anything
// else (null, "5e0", "5.", "1.5", 1.5) are not ok.
func lenientInt(v []byte) (int64, bool) {
	if len(v) == 0 {
		return 0, false
	}
	switch v[0] {
	case 't', 'f':
		b, ok := jsonraw.Bool(v)
		if !ok {
			return 0, false
		}
		if b {
			return 1, true
		}
		return 0, true
	case '"':
		s, ok := jsonraw.String(v)
		if !ok {
			return 0, false
		}
		return strInt(s)
	}
	return numberInt(v)
}

// numberInt reads a JSON number whose value is an integer (pydantic's
// float_as_int for numbers that are not integer literals).
func numberInt(v []byte) (int64, bool) {
	if n, ok := jsonraw.Int(v); ok {
		return n, true
	}
	if len(v) == 0 || !(v[0] == '-' || ('0' <= v[0] && v[0] <= '9')) {
		return 0, false
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) || f != math.Trunc(f) {
		return 0, false
	}
	if f <= math.MinInt64 || f >= math.MaxInt64 {
		return 0, false
	}
	return int64(f), true
}

// strInt is pydantic-core's str_as_int (clean_int_str) for values that fit
// in an int64.
func strInt(s string) (int64, bool) {
	s = strings.TrimSpace(s)
	neg := false
	if rest, ok := strings.CutPrefix(s, "+"); ok {
		s = rest
		if strings.HasPrefix(s, "-") {
			return 0, false
		}
	}
	if rest, ok := strings.CutPrefix(s, "-"); ok {
		s, neg = rest, true
	}
	// A fraction of zeros ("5.00") is dropped; any other fraction is not
	// an integer.
	if i := strings.IndexByte(s, '.'); i >= 0 {
		frac := s[i+1:]
		if frac == "" || strings.Trim(frac, "0") != "" {
			return 0, false
		}
		s = s[:i]
	}
	if s == "" || s[0] == '_' || s[len(s)-1] == '_' || strings.Contains(s, "__") {
		return 0, false
	}
	digits := make([]byte, 0, len(s)+1)
	if neg {
		digits = append(digits, '-')
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case '0' <= c && c <= '9':
			digits = append(digits, c)
		case c == '_':
		default:
			return 0, false
		}
	}
	n, err := strconv.ParseInt(string(digits), 10, 64)
	if err != nil {
		return 0, false
	}
	return n, true
}

// flagTrue reports whether the request sets the boolean flag key to a
// value other than false: absent and null read as false, a value that
// pydantic would not read as a bool as true, so that a caller refusing on
// true also refuses what it cannot read.
func flagTrue(req *Request, key string) bool {
	v, ok := req.Field(key)
	if !ok || jsonraw.IsNull(v) {
		return false
	}
	b, ok := lenientBool(v)
	return b || !ok
}
