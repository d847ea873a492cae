// Package kvroute routes the turns of multi-turn conversations over vLLM
// prefill (P) and decode (D) engines with bidirectional KV transfer, so that
// a later turn's prefill pulls the KV the decode engine kept from the turn
// before instead of recomputing the whole history.
//
// A Router is an http.Handler for POST /v1/chat/completions,
// /v1/completions, /v1/responses (Codex) and /v1/messages (Claude Code;
// APIs lists the routes); a service that wants the stream itself calls Do
// and reads Response.Next, or Response.WriteTo.
//
//	router, err := kvroute.New(kvroute.WithPrefill("http://10.0.0.1:8100"), kvroute.WithDecode("http://10.0.0.2:8200"))
//
// # The turn
//
// Router.Do runs one turn as a sequence of phases, each in its own file
// (ARCHITECTURE.md draws them):
//
//  1. Read (request.go): the request is validated; its principal, tenant and
//     conversation hint fixed.
//  2. Look up (lookup.go): the Identifier names the keys the request may
//     continue; the first handle found is taken from the Store atomically,
//     so a handle goes to at most one prefill request, ever.
//  3. Verify (verify.go): the handle is attached only when the prompt
//     begins with what its blocks hold, cut to the verified prefix, and
//     only when the threshold.Policy finds those tokens worth a pull.
//  4. Choose the path (lookup.go): pull, recompute, or answer on the decode
//     engine that holds the conversation (WithDecodeMemory's Local).
//  5. Prefill (prefill.go): the client's body goes to P with max_tokens 1
//     and the retained handle, or the miss handle; P answers its own.
//  6. Decode (decode.go): the body goes to D with P's handle; D's answer
//     reaches the caller with every kv_transfer_params removed (sse.Scrub).
//  7. Retain (retain.go): after a normal finish, D's new handle is retained
//     with a fingerprint of what its blocks hold.
//
// # Verification
//
// P copies D's blocks by position and never compares tokens. VerifyTokens,
// the default, proves the prefix before P pulls: D returns its token ids, a
// fingerprint of them is kept with the handle, and the next prompt is
// rendered by the prefill engine that will compute it and compared block by
// block; only the common block-aligned prefix is attached. VerifyContent
// needs no engine support and reuses exact resends only. A verification
// that cannot run never fails a turn: the turn is a counted miss.
//
// Handles are scoped by tenant (WithTenant; PrincipalTenant, from the
// request's principal, by default): a request never finds a handle another
// tenant's turn retained. Identifiers only find handles; verification
// decides whether one is attached.
//
// # Errors
//
// Before any response byte, errors reach a client in the API's own JSON
// shape: 400 for a malformed request (ErrBadRequest), an engine's 4xx as is,
// 502 or 504 naming the failed phase (*UpstreamError), 503 with Retry-After
// when no engine can take the turn. Once a stream has started, an error
// ends it with the API's error event and nothing is retained. A Store
// failure never fails a turn: it is a miss.
//
// # Options
//
// New applies the options (endpoints, Store, Identifier, tenant, Selector,
// Observer, Tracer, and the groups WithTTLs, WithTimeouts, WithLimits,
// WithFailover, WithHealth, WithVerification, WithDecodeMemory; a zero
// field keeps its default, see Defaults), then validates once: each problem
// wraps ErrInvalidConfig and names the option and the field.
//
// A Router is safe for concurrent use; Close stops its background work.
//
// docs/kvroute.md at the repository's root has the rest: the wire
// protocol, verification in full, decode-local turns, decode memory,
// embedding, memory bounds, many engines, every failure path and tracing;
// docs/migration.md maps the option names from before they were grouped.
package kvroute
