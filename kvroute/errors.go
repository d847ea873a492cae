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
