package kvroute

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"time"

	"github.com/bidikv/bidikv/transport"
)

// Sentinel errors. Match them with errors.Is.
var (
	// ErrInvalidConfig is wrapped by every error New returns for a bad option.
	ErrInvalidConfig = errors.New("kvroute: invalid configuration")
	// ErrBadRequest is wrapped by errors about the client's request: the
	// client gets 400.
	ErrBadRequest = errors.New("kvroute: bad request")
	// ErrNoHandle means the prefill engine answered without a
	// kv_transfer_params handle, so the decode leg cannot pull its KV.
	ErrNoHandle = errors.New("kvroute: prefill engine returned no KV transfer handle")
	// ErrNoEndpoint means no endpoint was available for a leg.
	ErrNoEndpoint = errors.New("kvroute: no endpoint available")
	// ErrClosed is returned by Do after Close.
	ErrClosed = errors.New("kvroute: router closed")
	// ErrStreamCut means the decode stream ended before its final event.
	ErrStreamCut = errors.New("kvroute: decode stream ended early")
)

// Phase names a step of a turn.
type Phase string

// The phases of a turn, in order.
const (
	PhaseLookup  Phase = "lookup"
	PhaseVerify  Phase = "verify" // token verification's render call; never fails a turn
	PhasePrefill Phase = "prefill"
	PhaseDecode  Phase = "decode"
	PhaseStream  Phase = "stream"
)

// UpstreamError reports a failed upstream leg.
type UpstreamError struct {
	Phase    Phase  // PhasePrefill, PhaseDecode or PhaseStream
	Endpoint string // base URL of the engine
	Status   int    // the engine's HTTP status, 0 when none was received
	Body     []byte // the engine's error body when it sent one (bounded), nil unless it is JSON naming no handle member
	Err      error  // the cause

	retryAfter time.Duration
}

// Error describes the failure without any request content.
func (e *UpstreamError) Error() string {
	s := "kvroute: " + string(e.Phase) + " on " + e.Endpoint
	if e.Status != 0 {
		s += ": status " + strconv.Itoa(e.Status)
	}
	if e.Err != nil {
		s += ": " + e.Err.Error()
	}
	return s
}

// Unwrap returns the cause.
func (e *UpstreamError) Unwrap() error { return e.Err }

// HTTPStatus maps an error from Do to the status a client should get: 400
// for ErrBadRequest; the engine's own 4xx when an engine rejected the
// request; 503 when an engine answered 503 or 429 (it is overloaded: the
// client should retry, after RetryAfter), when no endpoint is available,
// the router is closed or a decode answer did not fit WithLimits'
// ChargeAnswer; 504 for timeouts; 502 for every other upstream
// failure.
func HTTPStatus(err error) int {
	var ue *UpstreamError
	switch {
	case err == nil:
		return http.StatusOK
	case errors.Is(err, ErrBadRequest):
		return http.StatusBadRequest
	case errors.Is(err, ErrNoEndpoint), errors.Is(err, ErrClosed), errors.Is(err, errAnswerCharge):
		return http.StatusServiceUnavailable
	case errors.As(err, &ue) && ue.Status >= 400 && ue.Status < 500 && ue.Status != http.StatusRequestTimeout && ue.Status != http.StatusTooManyRequests:
		return ue.Status
	case errors.As(err, &ue) && (ue.Status == http.StatusTooManyRequests || ue.Status == http.StatusServiceUnavailable):
		return http.StatusServiceUnavailable
	case errors.Is(err, transport.ErrFirstByteTimeout), errors.Is(err, transport.ErrIdleTimeout),
		errors.Is(err, transport.ErrTotalTimeout), errors.Is(err, context.DeadlineExceeded):
		return http.StatusGatewayTimeout
	default:
		return http.StatusBadGateway
	}
}

// defaultRetryAfter is the Retry-After of a 503 when the engine that
// caused it sent none; maxRetryAfter bounds the engine's.
const (
	defaultRetryAfter = time.Second
	maxRetryAfter     = 5 * time.Minute
)

// RetryAfter returns how long a client should wait before it retries
// after err, for an error HTTPStatus maps to 503: the Retry-After of the
// engine's 503 or 429 answer when it sent one (at most maxRetryAfter,
// rounded up to whole seconds), else defaultRetryAfter. It is 0 for every
// other error. ServeHTTP sends it as the Retry-After header.
func RetryAfter(err error) time.Duration {
	if HTTPStatus(err) != http.StatusServiceUnavailable {
		return 0
	}
	var ue *UpstreamError
	if errors.As(err, &ue) && ue.retryAfter > 0 {
		d := min(ue.retryAfter, maxRetryAfter)
		return (d + time.Second - 1).Truncate(time.Second)
	}
	return defaultRetryAfter
}

// clientMessage is err as a client may read it. An UpstreamError names its
// phase, the engine's status and the cause, never the engine's address:
// a network error, whose text names addresses, is told as "the engine
// could not be reached". Logs keep err.Error(), which names the engine.
func clientMessage(err error) string {
	if err == nil {
		return "kvroute: error"
	}
	var ue *UpstreamError
	if !errors.As(err, &ue) {
		return err.Error()
	}
	s := "kvroute: " + string(ue.Phase) + " failed"
	if ue.Status != 0 {
		s += ": engine status " + strconv.Itoa(ue.Status)
	}
	if c := publicCause(ue.Err); c != "" {
		s += ": " + c
	}
	return s
}

// publicCause is the cause of an UpstreamError as a client may read it.
func publicCause(err error) string {
	if err == nil {
		return ""
	}
	for _, known := range [...]error{transport.ErrFirstByteTimeout, transport.ErrIdleTimeout, transport.ErrTotalTimeout,
		context.DeadlineExceeded, context.Canceled} {
		if errors.Is(err, known) {
			return known.Error()
		}
	}
	var (
		ne net.Error
		ue *url.Error
	)
	if errors.As(err, &ne) || errors.As(err, &ue) {
		return "the engine could not be reached"
	}
	return err.Error()
}

// errorBody renders err in OpenAI's error shape. It never includes request
// content: messages come from the router's own errors, and an engine's
// error message is included only as the engine wrote it.
func errorBody(status int, err error) []byte {
	typ, code := errorKind(status, err)
	b, _ := json.Marshal(openAIError{Error: openAIErrorDetail{Message: clientMessage(err), Type: typ, Code: code}})
	return b
}

// errorKind is the type and code of OpenAI's error shape for err.
func errorKind(status int, err error) (typ, code string) {
	typ = "server_error"
	code = "upstream_error"
	switch {
	case status == http.StatusBadRequest || status == http.StatusRequestEntityTooLarge || status == http.StatusUnprocessableEntity:
		typ, code = "invalid_request_error", "invalid_request"
	case status == http.StatusNotFound:
		typ, code = "invalid_request_error", "not_found"
	case status == http.StatusMethodNotAllowed:
		typ, code = "invalid_request_error", "method_not_allowed"
	case status == http.StatusUnauthorized:
		typ, code = "authentication_error", "invalid_api_key"
	case status == http.StatusServiceUnavailable:
		code = "upstream_unavailable"
	case status == http.StatusGatewayTimeout:
		code = "upstream_timeout"
	}
	var ue *UpstreamError
	if errors.As(err, &ue) {
		code = string(ue.Phase) + "_failed"
		if status == http.StatusGatewayTimeout {
			code = string(ue.Phase) + "_timeout"
		}
	}
	return typ, code
}

type openAIError struct {
	Error openAIErrorDetail `json:"error"`
}

type openAIErrorDetail struct {
	Message string  `json:"message"`
	Type    string  `json:"type"`
	Param   *string `json:"param"`
	Code    string  `json:"code"`
}

func badRequest(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadRequest, fmt.Sprintf(format, args...))
}

// The names of every outcome the router reports, typed so that a record
// field can only hold its own kind: the reuse outcome of a turn and why it
// missed (TurnRecord.Reuse, MissReason), why a finished turn's handle was
// not retained (Retention.Refusal, TurnRecord.StoreRefusal), where a
// prompt's tokens came from (TurnRecord.TokenSource) and what happened to
// an endpoint (EndpointEvent.Kind). Each type is a string so that metrics
// and logs can use it as a label as is.

// ReuseOutcome is whether a turn reused a retained handle.
type ReuseOutcome string

// MissReason is why a turn reused no handle.
type MissReason string

// Refusal is why a finished turn's handle was not retained, or was
// retained for token verification only (a soft refusal, see Retention). A
// finish reason other than a normal one (stop, length, or chat's
// tool_calls, which Messages' tool_use maps to) is refused as "finish_"
// and the reason ("finish_abort").
type Refusal string

// TokenSource is where the tokens of a new prompt came from.
type TokenSource string

// EndpointEventKind is what happened to an endpoint.
type EndpointEventKind string

// Reuse outcomes of a turn.
const (
	ReuseHit  ReuseOutcome = "hit"  // a retained handle was attached to the prefill request
	ReuseMiss ReuseOutcome = "miss" // no usable handle: the prefill engine computed everything it lacked
	ReuseOff  ReuseOutcome = "off"  // reuse disabled (WithReuse(false)), or an API the router passes through to one engine
)

// Miss reasons reported in TurnRecord.MissReason.
const (
	MissNoKey MissReason = "no_key" // the Identifier failed to derive lookup keys (its Lookup returned an error)
	// MissNotFound: no handle retained under any of the request's keys, or
	// the Identifier gave no key at all. Every first turn reports it, in
	// every Identifier mode.
	MissNotFound   MissReason = "not_found"
	MissExpired    MissReason = "expired"     // a handle was found past the retention TTL
	MissThreshold  MissReason = "threshold"   // too few reusable tokens for the policy
	MissStoreError MissReason = "store_error" // the Store failed; the turn went on as a miss
	MissBadEntry   MissReason = "bad_entry"   // the retained value was unusable
	MissRetry      MissReason = "retry"       // the prefill leg with the handle failed and was retried without it
	MissMismatch   MissReason = "mismatch"    // a handle was found but the request does not continue it
	// MissUnverified: a handle was found but could not be verified (no
	// render endpoint or token ids for this request, and the handle was
	// not retained under content rules); the turn ran as a plain prefill.
	MissUnverified MissReason = "unverified"
	// MissPartialRefused: only a prefix of the handle's tokens matched and
	// the handle cannot be read partially (dcp_size > 1, KV groups of
	// unequal length as a hybrid model's, a block count that does not fit
	// its decode engine's block size, that size unknown, or a negative
	// BlockSize (WithVerification)).
	MissPartialRefused MissReason = "partial_refused"
	// MissEndpointGone: a handle was found whose decode endpoint is no
	// longer among the Router's decode endpoints (SetEndpoints removed it):
	// the prefill engine could not pull its blocks, so it is not attached.
	// It is put back for the rest of its retention time, in case the
	// endpoint returns (or another router sharing the store still lists
	// it), and otherwise expires (Stats.GoneHandles).
	MissEndpointGone MissReason = "endpoint_gone"
	// MissRestarted: a handle was found whose decode engine restarted
	// since it issued it (a later process_start_time_seconds, another
	// engine id, or a failure to reach an engine without that metric):
	// its blocks hold other content now, so it is dropped
	// (Stats.RestartedHandles).
	MissRestarted MissReason = "engine_restarted"
	// MissEngineUnconfirmed: the decode engine's /metrics could not be
	// read to check that it did not restart (WithHealth's RestartCheck); the handle
	// is put back and may be attached once the engine answers.
	MissEngineUnconfirmed MissReason = "engine_unconfirmed"
	// MissRenderMismatch: the prefill engine that rendered the prompt
	// computed other tokens within the attached prefix (its prefill leg
	// asks for return_token_ids): the handle was spent on a wrong pull, and
	// the turn was redone as a plain miss on another prefill engine, or on
	// the decode engine when no other is left (Stats.RenderMismatches).
	// The conversation's later turns avoid that engine (its prefix cache
	// may hold the pulled blocks under the tokens it computed); a turn
	// whose only prefill engines are avoided runs on the decode engine
	// with its handle put back, also reported as MissRenderMismatch.
	MissRenderMismatch MissReason = "render_mismatch"
)

// Refusal reasons reported by ContinuationKeys (TurnRecord.StoreRefusal).
const (
	// RefuseNoConversationID: ContinuationKeys.ByConversationID found
	// neither a conversation_id nor an X-Session-ID.
	RefuseNoConversationID Refusal = "no_conversation_id"
	RefuseReasoning        Refusal = "reasoning"
	RefuseN                Refusal = "n"
	RefuseTruncate         Refusal = "truncate_prompt_tokens"
	RefuseStopString       Refusal = "stop_string"
	RefuseContinueFinal    Refusal = "continue_final_message"
	RefuseEcho             Refusal = "echo"
	RefuseIncomplete       Refusal = "incomplete_reply"
	RefuseTooLarge         Refusal = "reply_too_large"
	RefuseUnkeyable        Refusal = "unkeyable_prompt"
	// RefuseNoGenerationPrompt: add_generation_prompt is false.
	RefuseNoGenerationPrompt Refusal = "no_generation_prompt"
	// RefuseInlineReasoning: the reply's content holds a reasoning close
	// tag.
	RefuseInlineReasoning Refusal = "inline_reasoning"
	// RefuseThinkingOff: chat_template_kwargs.enable_thinking is not true.
	RefuseThinkingOff Refusal = "thinking_disabled"
	// RefuseTokenBoundary: a completions prompt and its reply do not meet
	// at a clean token boundary, or their text ends in whitespace.
	RefuseTokenBoundary Refusal = "token_boundary"
)

// RefuseTokenOnly (soft): a Responses or Messages turn. ContinuationKeys
// keys these APIs by their anchor only, for token verification; it has no
// content rules for their items and blocks.
const RefuseTokenOnly Refusal = "token_verification_only"

// Why a finished turn's handle was not retained (TurnRecord.StoreRefusal),
// besides the Identifier's own reasons (the Refuse* constants of
// ContinuationKeys and of token verification).
const (
	RefuseReuseOff        Refusal = "reuse_off"        // WithReuse(false), or an API the router passes through
	RefuseNoHandle        Refusal = "no_handle"        // a non-streaming answer without a handle
	RefuseNoStreamHandle  Refusal = "no_stream_handle" // a stream without a handle (stock vLLM)
	RefuseUnusableHandle  Refusal = "unusable_handle"  // a handle an engine would not act on
	RefuseInvalidHandle   Refusal = "invalid_handle"   // a handle with a value vLLM cannot read correctly (Stats.InvalidHandles)
	RefusePushHandle      Refusal = "push_handle"      // transfer_mode "push": not usable bidirectionally
	RefuseHandleTooLarge  Refusal = "handle_too_large" // the entry is over WithMaxEntryBytes or the Store's value bound
	RefuseIdentifierError Refusal = "identifier_error" // the Identifier failed
	RefuseStoreError      Refusal = "store_error"      // the Store failed
	RefuseNotJSON         Refusal = "not_json"         // the decode answer was JSON but not an object
	RefuseStreamError     Refusal = "stream_error"     // the stream broke
	RefuseClosedEarly     Refusal = "closed_early"     // the caller closed the stream before its end
	// RefuseRenderPending: an API without token ids whose prompt render (a
	// trial of its engine's render breaker) had not answered when the turn
	// ended; the handle is retained when it answers (Stats.Stored counts it
	// then), or not at all.
	RefuseRenderPending Refusal = "render_pending"
	// RefuseUnrendered: an API without token ids whose prompt could not be
	// rendered; its turn cannot be verified by tokens and is not retained.
	RefuseUnrendered Refusal = "unrendered"
	// refuseFinishPrefix prefixes a finish reason that is not a normal
	// finish (finishedNormally): "finish_abort", "finish_error".
	refuseFinishPrefix Refusal = "finish_"
	// refuseSessionFinal is TurnRecord.StoreRefusal of a turn whose
	// request ended its session (X-Dynamo-Session-Final: true): its
	// handle is released, not retained (retain.go).
	refuseSessionFinal Refusal = "session_final"
)

// Where the tokens of a new prompt came from (TurnRecord.TokenSource).
const (
	TokensFromPrompt   TokenSource = "prompt"   // a completions prompt given as token ids
	TokensFromRender   TokenSource = "render"   // POST /v1/chat/completions/render or /v1/completions/render
	TokensFromTokenize TokenSource = "tokenize" // POST /tokenize (older engines)
)

// Kinds of EndpointEvent.
const (
	EndpointEjected    EndpointEventKind = "ejected"    // consecutive failures took it out of rotation
	EndpointReadmitted EndpointEventKind = "readmitted" // it answered again after an ejection
	EndpointAdded      EndpointEventKind = "added"      // SetEndpoints added it
	EndpointRemoved    EndpointEventKind = "removed"    // SetEndpoints removed it
)
