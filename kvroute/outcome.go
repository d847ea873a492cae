package kvroute

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
