package kvroute

import (
	"context"
	"net/http"
	"time"

	"github.com/bidikv/bidikv/threshold"
)

// Observer receives one TurnRecord per turn, when the turn ends: after the
// last byte of a stream, after a non-streaming body, or on failure. It is
// called synchronously on the goroutine that ended the turn and must not
// block; it must not keep rec after returning. It is a public seam
// (ARCHITECTURE.md, Seams), given with WithObserver.
type Observer interface {
	ObserveTurn(rec *TurnRecord)
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(rec *TurnRecord)

// ObserveTurn calls f(rec).
func (f ObserverFunc) ObserveTurn(rec *TurnRecord) { f(rec) }

// TurnRecord describes one finished turn. Durations are measured on the
// router's clock from the moment Do started.
//
// Each field's `turn` tag declares how it is shown: its snake_case key and
// its kind (id, enum, flag, count, duration, error; "always" shows it even
// when zero). bidikv-proxy's log and /metrics and the otelobserver's spans
// derive what they show from these tags, so a new field is one line here.
type TurnRecord struct {
	// RequestID is the id the client sees (X-Request-Id of the answer):
	// the client's own, or one the router generated.
	RequestID string `turn:"request_id,id,always"`
	// EngineRequestID is the X-Request-Id every engine request of the turn
	// carried (both legs, and render calls with a "-render" suffix): for a
	// client's id, that id and 16 random hex digits, so that two clients
	// choosing the same id never collide on an engine; else RequestID.
	EngineRequestID string `turn:"engine_request_id,id,always"`
	Path            string `turn:"path,id,always"`
	Stream          bool   `turn:"stream,flag,always"`

	// Reuse is ReuseHit, ReuseLocal, ReuseMiss or ReuseOff; "" when the turn failed
	// before the lookup (a closed Router, a malformed request: ErrPhase is
	// PhaseLookup), which is no reuse miss.
	Reuse          ReuseOutcome  `turn:"reuse,enum,always"`
	MissReason     MissReason    `turn:"miss_reason,enum,always"`      // a Miss* constant when Reuse is ReuseMiss
	HandleAge      time.Duration `turn:"handle_age,duration,always"`   // age of the attached handle on a hit
	ReusableTokens int           `turn:"reusable_tokens,count,always"` // tokens the attached handle lets P read: remote_num_tokens, or the verified prefix
	// CachedTokens is usage.prompt_tokens_details.cached_tokens of the
	// last prefill answer, -1 when the engine reported none (engines
	// without --enable-prompt-tokens-details) or no prefill answer came.
	CachedTokens int `turn:"cached_tokens,count"`
	// Unconfirmed reports a hit whose CachedTokens is below ReusableTokens
	// less one (the last prompt token, which the engine recomputes): the
	// engine did not read what it was given (Stats.UnconfirmedHits).
	Unconfirmed bool `turn:"unconfirmed,flag"`
	// Verification is how the attached (or rejected) handle was checked:
	// VerifyTokens, VerifyContent, or "" when no handle was found.
	Verification VerificationMode `turn:"verification,enum"`
	// HandleTokens is remote_num_tokens of the handle found, before any
	// cut to the verified prefix (0 when none was found).
	HandleTokens int `turn:"handle_tokens,count"`
	// VerifiedTokens is the common prefix, in tokens, of the new prompt and
	// the sequence the handle's blocks hold (token verification only).
	VerifiedTokens int `turn:"verified_tokens,count"`
	// PromptTokens is the new prompt's length in tokens, when token
	// verification obtained it.
	PromptTokens int `turn:"prompt_tokens,count"`
	// Partial reports that the handle was cut to the verified prefix.
	Partial bool `turn:"partial,flag"`
	// TokenSource says where the prompt's tokens came from (TokensFrom*),
	// "" when they were not needed.
	TokenSource TokenSource `turn:"token_source,enum"`
	// Render is the time spent obtaining the prompt's tokens (the render
	// call), part of the turn's TTFT.
	Render time.Duration `turn:"render,duration"`

	PrefillEndpoint string `turn:"prefill_endpoint,id,always"`
	DecodeEndpoint  string `turn:"decode_endpoint,id,always"`
	PrefillAttempts int    `turn:"prefill_attempts,count,always"`
	LocalFallback   bool   `turn:"local_fallback,flag"` // D prefilled locally: P returned no handle (WithFailover's LocalPrefill), one that did not fit its block size, or only prefill engines serving without reuse were left (EndpointStatus.NoReuse)
	// NoHandle names the leg that answered without a handle although one
	// was expected: PhasePrefill (Stats.NoPrefillHandle) or PhaseDecode
	// (Stats.NoDecodeHandle); "" otherwise.
	NoHandle Phase `turn:"no_handle,enum"`

	Prefill   time.Duration `turn:"prefill,duration,always"`    // the prefill leg, request to P's answer
	FirstByte time.Duration `turn:"first_byte,duration,always"` // decode request to D's response headers
	TTFT      time.Duration `turn:"ttft,duration,always"`       // Do's start to the first event (or body) handed to the caller
	Total     time.Duration `turn:"total,duration,always"`      // Do's start to the end of the turn
	Bytes     int64         `turn:"bytes,count,always"`         // response bytes handed to the caller

	// Choice is the path the Chooser took for this turn (WithDecodeMemory's Local):
	// threshold.PathPull, PathLocal or PathRecompute; "" when it was not
	// asked (decode-local off, no handle verified by tokens, or the
	// handle's decode engine unavailable). A decode-local leg that failed
	// and ran again as a plain miss reports Reuse ReuseMiss, MissRetry.
	Choice threshold.Path `turn:"choice,enum,always"`
	// EstimatedTTFT is the Chooser's estimate of Choice's engine time to
	// first token (the legs, without render or the router's own work), to
	// compare with TTFT; 0 without an estimate.
	EstimatedTTFT time.Duration `turn:"estimated_ttft,duration,always"`
	// LocalRefusal says why a turn estimated cheapest on its decode engine
	// did not go there (threshold.RefuseLocalSuffix, RefuseLocalAge,
	// RefuseLocalBusy).
	LocalRefusal string `turn:"local_refusal,enum"`
	// PeerSource is the decode engine whose CPU tier the prefill leg was
	// told to pull the conversation from (DecodeMemory's CPUTierTokens,
	// threshold.PathPeer), "" when none; PeerTokens is what the ledger
	// estimated that tier still held of it, at most the whole blocks
	// short of the prompt's last token (what vLLM can load, once the
	// prompt's length is known). What the pull loaded is the
	// prefill engine's to say (its cached tokens): a chunk the tier lost
	// ends the pull, and the engine computes the rest.
	PeerSource string `turn:"peer_source,id"`
	PeerTokens int    `turn:"peer_tokens,count"`
	// PeerShort: the prefill engine reported fewer cached tokens
	// (usage.prompt_tokens_details, vLLM's --enable-prompt-tokens-details)
	// than PeerTokens less a block: the pull missed.
	PeerShort bool `turn:"peer_short,flag"`
	// LocalShort: a decode-local turn chosen because its decode engine's
	// CPU tier was estimated to hold the conversation, whose engine
	// reported fewer cached tokens than that estimate less a block: the
	// reload missed and the decode engine computed the history.
	LocalShort bool `turn:"local_short,flag"`

	Stored       bool    `turn:"stored,flag,always"`        // D's handle was retained for the next turn
	StoreRefusal Refusal `turn:"store_refusal,enum,always"` // why nothing was retained, when Stored is false

	// Buffered reports a streamed turn whose decode leg ran non-streaming
	// (WithDecodeMemory's BufferStreams): the router wrote D's answer to
	// the client as the API's own stream once it had arrived, so TTFT is
	// the whole decode.
	Buffered bool `turn:"buffered,flag"`
	// Missing names the engine capability whose absence made the turn
	// reuse or retain less than it could, "" when none did:
	// "no_render_route" (the prefill engine serves no render route for the
	// API and /tokenize could not stand in), "no_stream_handle" (the
	// decode engine's stream ended normally without a handle: stock vLLM
	// on chat and completions, vLLM's Messages always), "no_api_handle" (an
	// engine answered a Responses or Messages request without
	// kv_transfer_params), "no_token_ids" (the decode engine sent no
	// token ids: retained under content rules only) or "no_bidirectional"
	// (an engine answered without a handle where one was due). Router.Endpoints
	// reports what the turns showed of each engine (EndpointStatus.Learned).
	Missing string `turn:"missing,enum"`
	// Released reports that the turn's prefill leg released the decode
	// engine's hold of the handle it found and did not attach (the handle
	// with remote_num_tokens 0: docs/kvroute.md, Decode memory): why is
	// MissReason (MissThreshold, MissMismatch, MissPartialRefused,
	// MissCostModel: superseded by this turn's handle; MissExpired:
	// unusable). The leg's answer is a miss's.
	Released bool `turn:"released,flag"`

	Err      error `turn:"err,error"`  // the turn's error, nil on success
	ErrPhase Phase `turn:"phase,enum"` // where it failed

	// calls counts the turn's retain and end calls, which a test asserts
	// run exactly once a turn (spine_test.go).
	calls struct{ retain, end int }
}

// lacks records the first engine capability the turn found missing
// (TurnRecord.Missing): the one write to the record that reads it.
func (t *turn) lacks(reason string) {
	if t.rec.Missing == "" {
		t.rec.Missing = reason
	}
}

// Tracer follows a turn while it runs, for distributed tracing: one span
// per turn, one per phase, and the trace context on every engine request,
// so that engines that trace (vLLM with --otlp-traces-endpoint) join the
// turn's trace. The module kvroute/otelobserver implements it with
// OpenTelemetry; kvroute itself depends on no tracing library. It is a
// public seam (ARCHITECTURE.md, Seams), given with WithTracer.
//
// The router calls a Tracer on the goroutines that run the turn (Do's, then
// the one reading a stream), never concurrently for one turn. Every
// function it returns is called exactly once. A Tracer must not block.
type Tracer interface {
	// StartTurn is called when Do starts, before the request is validated.
	// ctx is Do's context and req the client's request (req.Header holds
	// the client's headers, where an inbound trace context is found). It
	// returns the context the turn runs in and the function called when
	// the turn ends, with the same record the Observer gets (after the
	// Observer); end must not keep rec.
	StartTurn(ctx context.Context, req *Request) (context.Context, func(rec *TurnRecord))
	// StartPhase is called when a phase starts: PhaseLookup within the
	// turn's context; PhaseVerify once per render or tokenize call, within
	// the lookup's; PhasePrefill once per prefill attempt and PhaseDecode once
	// per decode leg, within the turn's; PhaseStream, once the stream's
	// first event was read, within its decode leg's. endpoint is the
	// engine's base URL ("" for PhaseLookup). It returns the phase's
	// context, from which the phase's engine requests are built, and the
	// function called when the phase ends, with the phase's error (nil on
	// success). A decode leg that streams ends with its stream.
	StartPhase(ctx context.Context, phase Phase, endpoint string) (context.Context, func(err error))
	// Inject writes the trace context of ctx, a phase's context, into h,
	// the headers of an engine request, replacing any trace context the
	// client sent (which the router otherwise forwards as it forwards
	// every end-to-end header).
	Inject(ctx context.Context, h http.Header)
}

// turnTrace is a turn's tracing state: the turn's span, and the decode
// leg's phases that stay open while its stream is read.
type turnTrace struct {
	tr                   Tracer            // WithTracer; nil: nothing is traced
	end                  func(*TurnRecord) // ends the turn's span
	endDecode, endStream func(error)       // the open decode leg's phases
}

// noEnd ends a phase when no Tracer is set.
func noEnd(error) {}

// start starts the turn's trace and returns the context it runs in.
func (t *turnTrace) start(ctx context.Context, req *Request) context.Context {
	if t.tr == nil {
		return ctx
	}
	ctx, t.end = t.tr.StartTurn(ctx, req)
	return ctx
}

// finish ends the turn's trace with its record, after any phase still
// open (a body is read, and the turn ends, within its decode leg).
func (t *turnTrace) finish(rec *TurnRecord) {
	t.endPhases(nil)
	if end := t.end; end != nil {
		t.end = nil
		end(rec)
	}
}

// phase starts a phase within ctx.
func (t *turnTrace) phase(ctx context.Context, phase Phase, endpoint string) (context.Context, func(error)) {
	if t.tr == nil {
		return ctx, noEnd
	}
	return t.tr.StartPhase(ctx, phase, endpoint)
}

// startDecode starts a decode leg's phase, which decodeDone, endPhases or
// finish ends.
func (t *turnTrace) startDecode(ctx context.Context, endpoint string) context.Context {
	if t.tr == nil {
		return ctx
	}
	ctx, t.endDecode = t.tr.StartPhase(ctx, PhaseDecode, endpoint)
	return ctx
}

// decodeDone ends a decode leg's phase with err, or for a stream (err nil,
// stream set) keeps it open and starts PhaseStream within it: both end
// with the stream (endPhases).
func (t *turnTrace) decodeDone(ctx context.Context, stream bool, endpoint string, err error) {
	if t.endDecode == nil {
		return // no Tracer, or the turn has ended
	}
	if err == nil && stream {
		_, t.endStream = t.tr.StartPhase(ctx, PhaseStream, endpoint)
		return
	}
	t.endPhases(err)
}

// endPhases ends the open stream and decode phases with err.
func (t *turnTrace) endPhases(err error) {
	if end := t.endStream; end != nil {
		t.endStream = nil
		end(err)
	}
	if end := t.endDecode; end != nil {
		t.endDecode = nil
		end(err)
	}
}

// inject writes the phase's trace context into an engine request's headers.
func (t *turnTrace) inject(ctx context.Context, h http.Header) {
	if t.tr != nil {
		t.tr.Inject(ctx, h)
	}
}
