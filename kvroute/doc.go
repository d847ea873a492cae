// Package kvroute routes the turns of multi-turn conversations over vLLM
// prefill (P) and decode (D) engines with bidirectional KV transfer, so that
// a later turn's prefill pulls the KV the decode engine kept from the turn
// before instead of recomputing the whole history.
//
// # The turn
//
// Router.Do runs one turn as a sequence of phases, each a function in its
// own file that takes what it needs and hands the next its result
// (ARCHITECTURE.md at the repository's root draws it and says where each
// concern lives):
//
//  1. Read (read.go): the request is validated, its principal, tenant and
//     conversation hint fixed.
//  2. Look up (lookup.go): the Identifier gives the retention keys the
//     request may continue, most specific first; the first handle found is
//     taken from the Store (atomically: a handle goes to at most one
//     prefill request, ever). A handle whose decode engine is gone or
//     restarted, or that expired, is not attached.
//  3. Verify (verify.go, a mode per file: verify_tokens.go,
//     verify_content.go): the handle is attached only when the request's
//     prompt begins with what its blocks hold (see Verification), and the
//     threshold.Policy finds the verified tokens worth a pull; it is cut to
//     a verified prefix when only a prefix matches. A handle taken but not
//     attached is put back for its remaining retention time.
//  4. Choose the path (path.go, WithDecodeMemory's Local): pull the
//     handle, recompute, or answer on the decode engine that holds it.
//  5. Prefill (prefill.go): the client's body goes to P with stream false,
//     max_tokens 1, ignore_eos true, max_completion_tokens, min_tokens,
//     min_completion_tokens, stream_options, stop and stop_token_ids
//     removed (P always finishes on length), and kv_transfer_params set to
//     the retained decode handle (role flags forced: do_remote_decode true,
//     do_remote_prefill false; every other key byte for byte) or, on a miss,
//     the miss handle. P answers one token and its own handle. A hit goes
//     to the prefill engine that rendered the prompt and, on chat and
//     completions, asks for return_token_ids, whose prompt ids must match
//     the verified tokens (see Verification). A Selector picks the engine.
//  6. Decode (decode.go): at once, the client's body goes to D with P's
//     handle. The decode engine that held the retained KV is preferred:
//     its own prefix cache still covers the conversation. The miss handle
//     never reaches D. D's answer is handed to the caller with every
//     kv_transfer_params removed, at any depth (sse.Scrub), and all other
//     bytes untouched, event by event for a stream. D's handle is read from
//     a non-streaming body or from a stream's final chunk (engines with
//     vLLM PR #40186; stock engines send none in streams, which is logged
//     once and counted).
//  7. Retain (retain.go): when the turn ended normally (stop, length or
//     tool calls in each API's terms, the stream complete), the handle is
//     retained under the key the Identifier derives from the request and
//     the reply, for the retention TTL, with the fingerprint the
//     verification seals of what D's blocks hold: for a non-streaming
//     answer before Do returns, for a stream before the client reads its
//     final event.
//
// A failed decode leg that reached nobody is redone in Do as a plain miss
// (see Failure paths), as is a decode-local leg that fails.
//
// # Wire protocol
//
// What the router sends to and reads from vLLM engines running the
// NixlConnector in pull mode with bidirectional_kv_xfer, as five messages:
//
//  1. To P on a miss: the miss handle {"do_remote_decode": true,
//     "do_remote_prefill": false, "remote_engine_id": null,
//     "remote_block_ids": null, "remote_host": null, "remote_port": null}.
//  2. To P on a hit: the retained D handle with do_remote_decode true and
//     do_remote_prefill false forced, every other member byte for byte
//     (remote_num_tokens and remote_block_ids cut to a verified prefix,
//     see Verification).
//  3. From P: a one-token answer whose top-level kv_transfer_params is P's
//     handle (do_remote_prefill true). P emits it on a normal finish;
//     older engines only when P stopped on its length cap, hence the
//     prefill rewrites of step 2 above.
//  4. To D: the client's body with P's handle, or with none when P gave
//     none and WithFailover's LocalPrefill is on. The miss handle never
//     reaches D (D would act as a prefiller).
//  5. From D: kv_transfer_params at the top level of a body, or on a
//     stream's final chunk (engines with vLLM PR #40186; stock engines send
//     none in streams). D keeps its blocks for decoder_kv_blocks_ttl. With
//     WithDecodeMemory's BufferStreams, a streamed turn whose D streams
//     carry none runs its leg non-streaming, and its answer is written to
//     the client as the API's stream once complete: the first token
//     arrives with the last (buffered streams).
//
// A handle is opaque JSON: numbers are kept as written and unknown members
// forwarded, but a client never supplies one. remote_engine_id,
// remote_request_id, remote_host and remote_port must be present and
// remote_block_ids non-empty (one list per KV group, or the flat list of
// very old engines), or the engine ignores it; a transfer_mode of "push"
// cannot be used bidirectionally. P pulls count = min(remote_num_tokens,
// prompt tokens) minus its local prefix-cache hit, recomputes instead when
// count is below kv_recompute_threshold, and reads positionally: for each
// group it uses the last blocks of the list, never comparing tokens, and
// then tells D to free the blocks whether it read them or not. So a handle
// is attached to at most one prefill request, ever.
//
// # Verification
//
// P copies D's blocks by position and never compares tokens: a read is
// correct only if D's first remote_num_tokens tokens are exactly the first
// tokens of P's new prompt. WithVerification chooses how the router proves
// that before P pulls (verifying after would be too late: with prefix
// caching, P caches pulled blocks under its own token hashes, so a bad read
// poisons later requests too).
//
// VerifyTokens (the default) is exact. The decode leg carries
// return_token_ids: true (unless the client asked itself, the ids are
// removed from what the client receives), so D's answer names the prompt
// and generated token ids; the first remote_num_tokens of them are what D's
// blocks hold. A fingerprint of that sequence (a 64-bit chained hash per
// block of WithVerification's BlockSize tokens and one over the whole sequence, 8 bytes a
// block; never the ids) is stored with the handle. On a later turn, after
// the Identifier's candidate is taken and if its tokens could pass the
// threshold at all, the new prompt is rendered by a prefill engine exactly
// as generation would (POST /v1/chat/completions/render or
// /v1/completions/render; older engines' /tokenize when the request uses
// none of the fields it ignores; a completions prompt of token ids is used
// as is), and compared block by block with the fingerprint. The engine that
// rendered is the one the prefill leg carrying the handle goes to, so the
// tokens verified are the tokens that engine computes even while engines of
// another version serve beside it; on chat and completions that leg asks
// for return_token_ids, and P's prompt ids are compared with the verified
// ones before the decode leg (prefiller.checkIDs): a difference distrusts the
// engine's renderer for five minutes (Stats.RenderMismatches), and one
// within the attached prefix redoes the turn as a plain miss on another
// prefill engine, or on the decode engine when none is left
// (MissRenderMismatch). That check comes after P pulled, and P's prefix
// cache may keep the pulled blocks under the tokens it computed, so the
// conversation's later turns avoid that engine (for an hour after the last
// of them, per Router). The longest common prefix L decides:
//
//   - L = remote_num_tokens: the handle is attached as stored.
//   - L shorter (an edited or compacted history, reasoning the template
//     stripped from the last reply, a chat template that rewrites past
//     turns, a reply whose tokens re-tokenize differently): the handle is
//     cut to the block-aligned prefix R' = L - L mod B (B = WithVerification's BlockSize):
//     remote_num_tokens becomes R' and every KV group's remote_block_ids
//     keeps its first R'/B blocks, so P reads exactly the verified blocks
//     (TurnRecord.Partial, Stats.PartialHits). A handle that cannot be cut
//     safely is not attached (MissPartialRefused): dcp_size above 1, KV
//     groups of unequal length (sliding-window or state groups), or a block
//     count other than ceil(remote_num_tokens/B), which catches a B that
//     differs from the engines' --block-size.
//   - L = 0, or R' below the threshold: not attached (MissMismatch,
//     MissThreshold), put back.
//
// Failure paths of verification never fail a turn. An engine that answers
// a render path with 404 or 501 is not asked on it for five minutes; with
// no render endpoint and no usable /tokenize, or a render call that fails,
// the candidate is verified by content instead if it was retained under
// content rules, else not attached (MissUnverified). A render call is
// bounded by WithTimeouts' Render; one that runs out of it, or three failures
// in a row, open the engine's render circuit breaker (5 s, doubling up to
// 5 min; Stats.RenderBreaks), during which no render call goes to it and
// turns go on without one (Stats.RenderSkipped), but for one trial per
// period. A decode engine that sends no token ids (older engines; vLLM
// drops them with media, or with include_reasoning false under a parser)
// makes its turn retained under content rules only. Each fallback is
// counted (Stats.TokenFallbacks, Stats.RenderFailures) and logged once.
//
// VerifyContent needs no engine support: a handle is attached only when the
// request resends the stored conversation and reply exactly (the
// Identifier's digests), and turns the next render could reproduce
// differently are not retained (ContinuationKeys lists the refusals). It
// cannot see what a chat template or a tokenizer does to the text, so it
// can be wrong where VerifyTokens cannot (README, Limitations).
//
// Both legs carry the same X-Request-Id (TurnRecord.EngineRequestID): a
// generated one, or the client's with 16 random hex digits appended, so
// that two clients choosing the same id never collide on an engine; the
// client gets its own id back (TurnRecord.RequestID). Both legs are built
// from the caller's context: a client that goes away cancels the prefill
// request or aborts the decode stream, and the engine frees its blocks. The router's own body fields (conversation_id) and any
// client-supplied kv_transfer_params are never forwarded; neither are the
// client's credentials (Authorization, X-Api-Key, Cookie,
// Proxy-Authorization).
//
// # Tenants
//
// Retained handles are scoped by tenant: a request never finds a handle
// another tenant's turn retained, whatever history it sends. The tenant
// (WithTenant; PrincipalTenant by default) derives from one value, the
// request's principal (Request.Principal), decided in one place: the
// principal an authenticating layer put in the request's context
// (ContextWithPrincipal, such as KeyPrincipal of the API key it matched),
// else a digest of the credentials in Authorization (any scheme, in any
// case) and X-Api-Key. One key is one principal
// whichever header carries it; two keys are two. Requests without any
// credential share one principal, "": put a router that serves several
// tenants behind an authenticating layer.
//
// Identifiers only find handles: a conversation id
// (ContinuationKeys.ByConversationID) as much as ContinuationKeys'
// digests. A handle is attached after token verification,
// or, for a handle without a fingerprint, after the Identifier's Verify,
// which must check that the request continues what the handle holds:
// attaching a handle to another prompt makes P answer wrongly and cache
// the pulled blocks under that prompt's tokens, for every tenant.
//
// # Decode-local turns
//
// With WithDecodeMemory's Local, a turn whose handle was verified by tokens
// may skip the prefill engine. A threshold.Chooser (by default a
// threshold.CostModel: estimated TTFT of each path from the verified and
// suffix token counts, rates learned online from the turns, the decode
// engine's load) picks one of three paths: pull (the hit above), recompute
// on P (the handle is put back; MissCostModel), or decode-local: the turn
// goes as a plain request, with no kv_transfer_params at all, to the decode
// engine that holds the handle, which computes only the suffix from its own
// prefix cache (the retained blocks keep it warm). A decode-local turn
// retains nothing (RefuseDecodeLocal) and puts the handle back, so it stays
// the candidate for the next long turn; no other shape is ever sent to a
// decode engine without P's handle (do_remote_prefill true without blocks
// kills current engines' cores; do_remote_prefill false leaks blocks).
// TurnRecord.Choice, EstimatedTTFT and LocalRefusal report the decision,
// Stats.Chose* count it, and Router.DecodeKV reports the KV each decode
// engine holds for live retained handles. The cost model bounds
// decode-local work per decode engine (suffix tokens, concurrent prefills)
// so decode batches are not starved. Turn it on only when the decode
// engines run with prefix caching (vLLM's default); the router cannot see
// it. It needs VerifyTokens: New refuses Local with another
// verification mode, where it would never send a turn decode-local. A decode-local leg that fails before any byte reached the client
// runs again as a plain miss (Stats.LocalFailures).
//
// # Decode memory
//
// vLLM pins every finished decode request's blocks for 480 s; DecodeMemory
// manages them (README, "Decode memory"; Budget, Headroom, RoomRate).
//
// # Embedding
//
// A Router is an http.Handler for POST /v1/chat/completions,
// /v1/completions, /v1/responses (OpenAI's Responses API, as coding agents
// such as Codex send it) and /v1/messages (Anthropic's Messages API, as
// Claude Code sends it; errors in Anthropic's shape). Each API is one
// descriptor (api_*.go) in one registry, which APIs lists for a front end:
// validation, the prefill rewrite (max_output_tokens 1 for Responses,
// max_tokens 1 and no stop_sequences for Messages), where the handle sits
// in a body and a stream, the reply, the render route and the error shape. vLLM returns no token ids on Responses and Messages, so token
// verification fingerprints each turn's rendered prompt there (POST
// /v1/responses/render, /v1/messages/render) and reuses at most that prompt,
// never the reply's tokens; they have no content rules. Responses'
// previous_response_id and background are refused with 400 (they need one
// stateful server); the prefill leg never stores. A turn there that was not
// rendered for verification renders its prompt beside its prefill leg, on
// the prefill engine, never after the answer: its retention waits for that
// render within WithTimeouts' Render, and not at all for a render breaker's
// trial call, whose turn is retained when it answers (RefuseRenderPending). vLLM's Messages streams
// carry no handle, so streamed Messages turns are not reused. Services that want the stream themselves call Do and
// read Response.Next, or Response.WriteTo.
//
// # Options
//
// Options configure the endpoints (WithPrefill, WithDecode, WithEndpoints),
// the Store (retention.Memory by default; retention/redisstore shares
// handles across replicas), the Identifier, the tenant, the Selector, the
// reuse policy, an Observer and a Tracer, and groups of knobs that form
// one concept: WithTTLs, WithTimeouts, WithLimits, WithFailover,
// WithHealth, WithVerification and WithDecodeMemory. A grouped option's
// zero field keeps its default (Defaults lists them all); a negative one
// turns a bound off where it can be off (a timeout, ejection, the restart
// reads, partial reads) and is an error elsewhere. New applies every
// option, then validates once: each problem is an error wrapping
// ErrInvalidConfig that names the option and the field.
//
// # Migration
//
// The options were grouped and the exported names trimmed; each old
// name and what replaces it:
//
//   - WithPrefillEndpoints(eps...), WithDecodeEndpoints(eps...):
//     WithEndpoints(PhasePrefill, eps...), WithEndpoints(PhaseDecode, eps...).
//   - WithRetentionTTL, WithDecoderBlocksTTL, WithPrefillLease: WithTTLs'
//     Retention, DecoderBlocks, PrefillLease.
//   - WithPrefillTimeout, WithFirstByteTimeout, WithIdleTimeout,
//     WithRenderTimeout: WithTimeouts' Prefill, FirstByte, Idle, Render (a
//     negative value, not 0, means no limit).
//   - WithMaxBodyBytes, WithMaxEventBytes, WithMaxEntryBytes,
//     WithMaxObjectMembers: WithLimits' Body, Event, Entry, ObjectMembers.
//   - WithRetryPolicy, WithDecodeAttempts, WithLocalPrefillFallback:
//     WithFailover's PrefillRetry, DecodeAttempts, LocalPrefill.
//   - WithEjection(n, first, limit), WithHealthCheck(interval, timeout),
//     WithRestartCheck(d): WithHealth's EjectAfter, EjectBackoff,
//     MaxEjectBackoff, ProbeInterval, ProbeTimeout, RestartCheck (a
//     negative value, not 0, turns ejection and the reads off).
//   - WithVerification(mode), WithBlockSize(n): WithVerification(
//     Verification{Mode: mode, BlockSize: n}), the mode's type now
//     VerificationMode (a negative BlockSize, not 0, disables partial
//     reads).
//   - WithDecodeLocal(on), WithKVBytesPerToken(n): WithDecodeMemory's Local
//     and KVBytesPerToken.
//   - DefaultRetentionTTL, DefaultDecoderBlocksTTL, DefaultPrefillLease,
//     DefaultPrefillTimeout, DefaultFirstByteTimeout, DefaultIdleTimeout,
//     DefaultRenderTimeout, DefaultMaxBodyBytes, DefaultMaxEventBytes,
//     DefaultMaxEntryBytes, DefaultMaxObjectMembers, DefaultEjectAfter,
//     DefaultEjectBackoff, DefaultMaxEjectBackoff, DefaultDecodeAttempts,
//     DefaultRestartCheck, DefaultBlockSize: the fields of Defaults().
//   - ExplicitID{Content: c}: c with ByConversationID set.
//   - RoundRobin: kvroutetest.RoundRobin (a measuring baseline).
//   - StreamErrorEvent(path, ...): Response.ErrorEvent for a turn's stream;
//     API.StreamErrorShape names each API's event.
//   - Response.Reuse, Response.RequestID: the response's X-Bidikv-Reuse and
//     X-Request-Id headers.
//   - AuthorizationTenant: PrincipalTenant, which it already was.
//   - Request.Chat, Request.Streaming: Request.Path ==
//     PathChatCompletions; the body's stream member (Request.Field).
//   - HeaderPrincipal(h): Request.Principal (the headers' principal when
//     the context carries none).
//   - ConversationHint: Selection.Hint, which carries it.
//   - MaxRequestIDBytes (128), ExpiryGuard (5 s), DefaultRetryAfter (1 s),
//     MaxRetryAfter (5 min), DefaultMaxReplyBytes (1 MiB), RefuseFinishPrefix,
//     DefaultReasoningCloseTag, DefaultAffinityMaxInFlight (64): unexported.
//   - Reply, Capture and the token-id helpers of package sse: moved into
//     kvroute (Reply is kvroute.Reply).
//
// # Errors
//
// Errors before any response byte reach an HTTP client in OpenAI's JSON
// error shape: 400 for a malformed request (ErrBadRequest), an engine's own
// 4xx passed through, 502 for a failed upstream leg (*UpstreamError names
// the phase, the endpoint and the status; what the client reads names the
// phase and the status, never the endpoint), 503 with Retry-After
// (RetryAfter: the engine's own, else defaultRetryAfter) when an engine
// answered 503 or 429 or no endpoint is available, 504 on a timeout. A
// prefill leg that fails on a connection error or with 502/503/504 is
// retried on another engine with backoff (see Failure paths). Once a stream
// has started, an error can only end it: ServeHTTP writes the API's error event
// (Response.ErrorEvent; API.StreamErrorShape: data: {"error":{...}} for chat
// and completions; event: error with {"type":"error","code","message",
// "param","sequence_number"} for Responses; Anthropic's event: error for
// Messages) and closes the connection without the stream's final event,
// and nothing is retained. A Store failure never fails a turn: it is a miss.
//
// # Memory
//
// A turn's memory follows its body's size. ServeHTTP reads a body of known length
// into a buffer that grows with what arrived (at most four times it, from
// 64 KiB), never one of the declared size; a body above WithLimits' Body gets
// 413. A body with an object of more than WithLimits' ObjectMembers members, at
// any depth, gets 400 before anything is indexed, so the member index stays
// small; both legs are sent as pieces of the client's bytes, a few per edited
// member. A decode answer held whole (non-streaming, or a buffered stream's) is
// charged to WithLimits' ChargeAnswer.
//
// # Many engines
//
// Each leg's engine is chosen by a Selector over the healthy endpoints
// (LeastLoaded by default): decode goes to the engine that holds the
// conversation's KV unless it is ejected or has defaultAffinityMaxInFlight
// requests open, else to the least loaded one per unit of weight; prefill
// takes the lighter of two random engines. With LeastLoaded.HashHints a
// conversation hint pins turns without affinity by rendezvous hashing; a
// hint never unlocks a handle. Endpoints carry a data-parallel rank
// (X-Data-Parallel-Rank) and a weight (WithEndpoints) and can be replaced
// at run time with SetEndpoints (package transport/discovery does so from
// DNS): a removed endpoint gets no new leg,
// turns already on it finish, and a retained handle of a removed decode
// endpoint is not attached (MissEndpointGone) but left to expire.
// WithHealth's ejection ejects an endpoint after consecutive failures for an
// exponential backoff; WithHealth's probes adds /health probes, which Close
// stops. An Observer that implements EndpointObserver hears of ejections,
// re-admissions, additions and removals.
//
// # Failure paths
//
// What the client sees, what is retained, what is counted (Stats, the
// TurnRecord given to the Observer, endpoint health):
//
//   - Prefill engine down, refusing, or answering 502/503/504: retried on
//     another engine with backoff, honouring Retry-After, within
//     WithFailover's PrefillRetry. An attempt that carried a retained handle spent it:
//     every retry is a plain miss (MissRetry, Stats.HitRetries). A prefill
//     that fails with 500 while reading a retained handle (expired, engine
//     restarted) is retried once as a miss. One classifier,
//     transport.Retryable, decides for the exchange (a pooled connection
//     the engine had closed is retried); what it does not retry (the
//     prefill total timeout, the caller's cancellation) fails the turn: 504
//     or 502. Each failure counts against the
//     endpoint's health, except a 500 on a failed handle read.
//   - P answers without a handle: 502 (ErrNoHandle, Stats.NoPrefillHandle,
//     TurnRecord.NoHandle PhasePrefill), or with WithFailover's LocalPrefill D
//     prefills by itself; the miss handle never reaches D. A client's stop
//     strings or an EOS as P's one token cannot cause this: the P leg drops
//     stop and stop_token_ids and sets ignore_eos, because older engines
//     emit P's handle only on the length cap. A handle with transfer_mode
//     "push" counts as none (Stats.PushHandles too).
//   - A hit P did not read: when P's usage.prompt_tokens_details.cached_tokens
//     is below the attached tokens less one (the last prompt token is always
//     recomputed), the turn goes on (its answer is still correct: P computed
//     what it lacked) and is counted (Stats.UnconfirmedHits,
//     TurnRecord.Unconfirmed, TurnRecord.CachedTokens). Engines without
//     --enable-prompt-tokens-details are not checked.
//   - D answers without a handle after a normal finish (stop, length, tool
//     calls): the turn succeeds, nothing is retained, and it is counted
//     (Stats.NoDecodeHandle, TurnRecord.NoHandle PhaseDecode; warned once
//     per engine) for non-streaming answers and for streams of an engine that has sent a
//     handle in a stream of that API before; streams of engines never seen
//     to send one (stock vLLM; vLLM's Messages streams always) count in
//     Stats.NoStreamHandle instead, warned once per API. D's
//     push-mode handle is never retained (StoreRefusal "push_handle",
//     Stats.PushHandles).
//   - Handles never reach a client, even from malformed engine output
//     (fail closed). Every decode answer goes through one mechanism,
//     sse.Scrub (ScrubEvent for a stream event), which decides on the
//     decoded JSON: a member whose decoded name is kv_transfer_params is
//     removed at any depth, whatever its escapes or duplicates (only a
//     top-level one, or the one in a Responses or Messages stream's
//     response or message object, is taken as D's handle); an answer that
//     is not JSON, or holds a member only handles have (remote_block_ids,
//     remote_engine_id, remote_request_id, remote_num_tokens,
//     remote_blocks_expiry_time, do_remote_decode, do_remote_prefill)
//     outside kv_transfer_params, fails: a 502 naming PhaseDecode for a
//     body, the stream's end with an error event for an event. So does an
//     answer with a Content-Encoding other than identity (the legs never
//     carry the client's Accept-Encoding, so engines have no reason to
//     compress; D's Content-Encoding is never copied). Such a failure is
//     not redone: the same request would likely bring the same answer. A
//     stream's lines outside the data are forwarded only when a client
//     reads them (comments, event, id, retry) and they are text naming no
//     handle member and holding no backslash; a byte order mark is ignored
//     at the start of the stream only, as by sse.Reader (elsewhere the line
//     is a field a client ignores, dropped). An event the stream ended
//     inside is never forwarded (a client would not dispatch it), and the
//     error event that follows starts on a fresh line. Engine headers that
//     name a handle are dropped, and an engine's error body that names a
//     handle member anywhere (vLLM's validation errors echo the request)
//     is replaced by the router's own error for the status. A Responses
//     request whose echoed members (metadata, tools, text, ...) hold such a
//     member is refused with 400 before any engine is asked.
//   - Large handles: a stream event is bounded by WithLimits' Event (16 MiB;
//     a longer one ends the stream with an error), a retained entry by
//     WithLimits' Entry (8 MiB, also the default store's value bound), room
//     for 1M-token contexts with two KV groups. An entry over the bound, or
//     one the Store refuses with retention.ErrTooLarge, is not retained
//     (StoreRefusal "handle_too_large", Stats.TooLarge), warned once.
//   - A client X-Request-Id longer than maxRequestIDBytes (128) or holding
//     anything but visible ASCII is ignored: the router generates its own
//     id for both legs, the response and the TurnRecord.
//   - A request that fails before the lookup (malformed body, closed
//     Router) reports TurnRecord.Reuse "" and ErrPhase PhaseLookup: it is no
//     reuse miss. A first turn is MissNotFound in every Identifier mode;
//     MissNoKey means the Identifier's Lookup failed.
//   - Decode leg fails before anything reached the client (Do has not
//     returned; a stream's first event is read inside Do): if the connection
//     was never made, the same P handle goes to another decode engine while
//     P's lease (WithTTLs' PrefillLease) has expiryGuard left. Any other failure
//     (refused after accept, 5xx, timeout, a stream cut before its first
//     event, a lapsed lease) redoes the whole turn as a plain miss: a new
//     prefill, preferring another prefill engine, then another decode
//     engine, because the failed D may have read P's handle. At most
//     WithFailover's DecodeAttempts decode legs per turn; then 502 or 504. A decode
//     engine's 4xx is passed to the client as is. A leg that timed out (no
//     headers within WithTimeouts' FirstByte, no first event within
//     WithTimeouts' Idle) is redone only for a healthy decode engine the turn
//     has not tried, and only after the turn's first timeout: a turn waits
//     for silent engines at most twice that timeout and runs at most two
//     prefills for them, and a silent engine never gets a second leg.
//   - After the first event: the stream ends with an SSE error event and no
//     data: [DONE]; nothing is retained; the turn counts in Stats.Failures
//     and against the endpoint's health.
//   - No endpoint left (all excluded this turn): 503 ErrNoEndpoint. When all
//     are ejected they are tried anyway.
//   - A retained handle past the retention TTL is a miss (MissExpired) and
//     is never attached.
//   - A decode engine restarted: the handles it issued before are never
//     attached (MissRestarted, dropped; Stats.RestartedHandles). Before
//     attaching one, the router reads the engine's
//     process_start_time_seconds (GET /metrics) when its last reading is
//     older than WithHealth's RestartCheck (1 s) or predates a failure to reach the
//     engine, and a handle issued before the engine started is dropped; a
//     new engine id in the engine's handles is a restart too, and on
//     engines without that metric a failure to reach them counts as one. A
//     /metrics that cannot be read leaves the handle in the store
//     (MissEngineUnconfirmed). Start times are compared with the router's
//     clock: keep clocks in sync.
//   - Handles vLLM would misread are refused, when captured (P's: as no
//     handle; D's: not retained, StoreRefusal "invalid_handle") and when
//     attached (MissBadEntry): block ids that are not integers from 0 to
//     2^31-1, a port outside 1 to 65535, counts of another type, a member
//     named twice, or a longest KV group with fewer than
//     ceil(remote_num_tokens/WithVerification's BlockSize) blocks (Stats.InvalidHandles;
//     logged once per member).
//
// # Tracing
//
// WithTracer sets a Tracer (kvroute/otelobserver implements it with
// OpenTelemetry, in its own module): a span for the turn, whose parent is
// the caller's (a span in Do's context, else the client's traceparent
// header), and one per phase within it: lookup, with one verify per render
// call; prefill, one per attempt; decode, one per decode leg, which for a
// stream holds the stream phase from the first event to the last. Every
// engine request carries its phase's trace context in place of the
// client's, so engines that trace (vLLM's --otlp-traces-endpoint) join the
// turn's trace. Without a Tracer nothing is traced and the client's trace
// headers are forwarded as any end-to-end header.
//
// # Concurrency
//
// A Router is safe for concurrent use. Close stops its background work.
package kvroute
