package otelobserver

import "go.opentelemetry.io/otel/attribute"

// Span names.
const (
	SpanTurn    = "bidikv.turn"
	SpanLookup  = "bidikv.lookup"
	SpanVerify  = "bidikv.verify"
	SpanPrefill = "bidikv.prefill"
	SpanDecode  = "bidikv.decode"
	SpanStream  = "bidikv.stream"
)

// Attribute keys of the spans (and, for AttrReuse, AttrMissReason,
// AttrRoute, AttrErrorPhase, AttrPhase and AttrEndpointEvent, of the
// metrics). Each names the kvroute.TurnRecord field it comes from.
const (
	AttrRequestID      = attribute.Key("bidikv.request_id")      // RequestID
	AttrRoute          = attribute.Key("http.route")             // Path
	AttrStream         = attribute.Key("bidikv.stream")          // Stream
	AttrReuse          = attribute.Key("bidikv.reuse")           // Reuse: hit, miss or off
	AttrMissReason     = attribute.Key("bidikv.miss_reason")     // MissReason, on a miss
	AttrReusableTokens = attribute.Key("bidikv.reusable_tokens") // ReusableTokens
	AttrVerifiedTokens = attribute.Key("bidikv.verified_tokens") // VerifiedTokens, under token verification
	AttrHandleTokens   = attribute.Key("bidikv.handle_tokens")   // HandleTokens, when a handle was found
	AttrPromptTokens   = attribute.Key("bidikv.prompt_tokens")   // PromptTokens, when rendered
	AttrCachedTokens   = attribute.Key("bidikv.cached_tokens")   // CachedTokens, when the engine reported them
	AttrVerification   = attribute.Key("bidikv.verification")    // Verification
	AttrTokenSource    = attribute.Key("bidikv.token_source")    // TokenSource
	AttrPartial        = attribute.Key("bidikv.partial")         // Partial, when true
	AttrUnconfirmed    = attribute.Key("bidikv.unconfirmed")     // Unconfirmed, when true
	AttrHandleAgeMS    = attribute.Key("bidikv.handle_age_ms")   // HandleAge, on a hit
	AttrPrefillURL     = attribute.Key("bidikv.prefill.endpoint")
	AttrDecodeURL      = attribute.Key("bidikv.decode.endpoint")
	AttrAttempts       = attribute.Key("bidikv.prefill.attempts") // PrefillAttempts
	AttrLocalFallback  = attribute.Key("bidikv.local_fallback")   // LocalFallback, when true
	AttrNoHandle       = attribute.Key("bidikv.no_handle")        // NoHandle, when set
	AttrTTFTMS         = attribute.Key("bidikv.ttft_ms")          // TTFT
	AttrFirstByteMS    = attribute.Key("bidikv.first_byte_ms")    // FirstByte
	AttrBytes          = attribute.Key("bidikv.response_bytes")   // Bytes
	AttrStored         = attribute.Key("bidikv.stored")           // Stored
	AttrStoreRefusal   = attribute.Key("bidikv.store_refusal")    // StoreRefusal, when set
	AttrReleased       = attribute.Key("bidikv.released")         // Released, when true: why is AttrMissReason
	AttrErrorPhase     = attribute.Key("bidikv.error.phase")      // ErrPhase, when the turn failed

	// AttrPhase is the phase of a phase span and of an endpoint event.
	AttrPhase = attribute.Key("bidikv.phase")
	// AttrEndpoint is a phase span's engine, its base URL.
	AttrEndpoint = attribute.Key("bidikv.endpoint")
	// AttrCanceled marks a phase or turn the caller cancelled.
	AttrCanceled = attribute.Key("bidikv.canceled")
	// AttrEndpointEvent is kvroute.EndpointEvent.Kind.
	AttrEndpointEvent = attribute.Key("bidikv.endpoint.event")
)
