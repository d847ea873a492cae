package kvroute

import "time"

// Observer receives one TurnRecord per turn, when the turn ends: after the
// last byte of a stream, after a non-streaming body, or on failure. It is
// called synchronously on the goroutine that ended the turn and must not
// block; it must not keep rec after returning.
type Observer interface {
	ObserveTurn(rec *TurnRecord)
}

// ObserverFunc adapts a function to Observer.
type ObserverFunc func(rec *TurnRecord)

// ObserveTurn calls f(rec).
func (f ObserverFunc) ObserveTurn(rec *TurnRecord) { f(rec) }

// Reuse outcomes of a turn.
const (
	ReuseHit  = "hit"  // a retained handle was attached to the prefill request
	ReuseMiss = "miss" // no usable handle: the prefill engine computed everything it lacked
	ReuseOff  = "off"  // reuse disabled (WithReuse(false))
)

// Miss reasons reported in TurnRecord.MissReason.
const (
	MissNoKey = "no_key" // the Identifier failed to derive lookup keys (its Lookup returned an error)
	// MissNotFound: no handle retained under any of the request's keys, or
	// the Identifier gave no key at all. Every first turn reports it, in
	// every Identifier mode.
	MissNotFound   = "not_found"
	MissExpired    = "expired"     // a handle was found past the retention TTL
	MissThreshold  = "threshold"   // too few reusable tokens for the policy
	MissStoreError = "store_error" // the Store failed; the turn went on as a miss
	MissBadEntry   = "bad_entry"   // the retained value was unusable
	MissRetry      = "retry"       // the prefill leg with the handle failed and was retried without it
	MissMismatch   = "mismatch"    // a handle was found but the request does not continue it
	// MissUnverified: a handle was found but could not be verified (no
	// render endpoint or token ids for this request, and the handle was
	// not retained under content rules); the turn ran as a plain prefill.
	MissUnverified = "unverified"
	// MissPartialRefused: only a prefix of the handle's tokens matched and
	// the handle cannot be read partially (dcp_size > 1, KV groups of
	// unequal length, a block count that does not fit WithBlockSize, or
	// WithBlockSize(0)).
	MissPartialRefused = "partial_refused"
)

// TurnRecord describes one finished turn. Durations are measured on the
// router's clock from the moment Do started.
type TurnRecord struct {
	RequestID string
	Path      string
	Stream    bool

	// Reuse is ReuseHit, ReuseMiss or ReuseOff; "" when the turn failed
	// before the lookup (a closed Router, a malformed request: ErrPhase is
	// PhaseLookup), which is no reuse miss.
	Reuse          string
	MissReason     string        // a Miss* constant when Reuse is ReuseMiss
	HandleAge      time.Duration // age of the attached handle on a hit
	ReusableTokens int           // tokens the attached handle lets P read: remote_num_tokens, or the verified prefix
	// CachedTokens is usage.prompt_tokens_details.cached_tokens of the
	// last prefill answer, -1 when the engine reported none (engines
	// without --enable-prompt-tokens-details) or no prefill answer came.
	CachedTokens int
	// Unconfirmed reports a hit whose CachedTokens is below ReusableTokens
	// less one (the last prompt token, which the engine recomputes): the
	// engine did not read what it was given (Stats.UnconfirmedHits).
	Unconfirmed bool
	// Verification is how the attached (or rejected) handle was checked:
	// VerifyTokens, VerifyContent, or "" when no handle was found.
	Verification Verification
	// HandleTokens is remote_num_tokens of the handle found, before any
	// cut to the verified prefix (0 when none was found).
	HandleTokens int
	// VerifiedTokens is the common prefix, in tokens, of the new prompt and
	// the sequence the handle's blocks hold (token verification only).
	VerifiedTokens int
	// PromptTokens is the new prompt's length in tokens, when token
	// verification obtained it.
	PromptTokens int
	// Partial reports that the handle was cut to the verified prefix.
	Partial bool
	// TokenSource says where the prompt's tokens came from (TokensFrom*),
	// "" when they were not needed.
	TokenSource string
	// Render is the time spent obtaining the prompt's tokens (the render
	// call), part of the turn's TTFT.
	Render time.Duration

	PrefillEndpoint string
	DecodeEndpoint  string
	PrefillAttempts int
	LocalFallback   bool // D prefilled locally because P returned no handle
	// NoHandle names the leg that answered without a handle although one
	// was expected: PhasePrefill (Stats.NoPrefillHandle) or PhaseDecode
	// (Stats.NoDecodeHandle); "" otherwise.
	NoHandle Phase

	Prefill   time.Duration // the prefill leg, request to P's answer
	FirstByte time.Duration // decode request to D's response headers
	TTFT      time.Duration // Do's start to the first event (or body) handed to the caller
	Total     time.Duration // Do's start to the end of the turn
	Bytes     int64         // response bytes handed to the caller

	Stored       bool   // D's handle was retained for the next turn
	StoreRefusal string // why nothing was retained, when Stored is false

	Err      error // the turn's error, nil on success
	ErrPhase Phase // where it failed
}

// Why a finished turn's handle was not retained (TurnRecord.StoreRefusal),
// besides the Identifier's own reasons (the Refuse* constants of
// ContinuationKeys and of token verification).
const (
	RefuseReuseOff        = "reuse_off"        // WithReuse(false)
	RefuseNoHandle        = "no_handle"        // a non-streaming answer without a handle
	RefuseNoStreamHandle  = "no_stream_handle" // a stream without a handle (stock vLLM)
	RefuseUnusableHandle  = "unusable_handle"  // a handle an engine would not act on
	RefusePushHandle      = "push_handle"      // transfer_mode "push": not usable bidirectionally
	RefuseHandleTooLarge  = "handle_too_large" // the entry is over WithMaxEntryBytes or the Store's value bound
	RefuseIdentifierError = "identifier_error" // the Identifier failed
	RefuseStoreError      = "store_error"      // the Store failed
	RefuseNotJSON         = "not_json"         // the decode answer was not JSON
	RefuseStreamError     = "stream_error"     // the stream broke
	RefuseClosedEarly     = "closed_early"     // the caller closed the stream before its end
	// RefuseFinishPrefix prefixes a finish reason other than stop or
	// length ("finish_abort", "finish_tool_calls" is not one: tool calls
	// finish as stop in vLLM).
	RefuseFinishPrefix = "finish_"
)
