package kvroute

import (
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
