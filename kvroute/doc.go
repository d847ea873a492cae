// Package kvroute routes the turns of multi-turn conversations over vLLM
// prefill (P) and decode (D) engines with bidirectional KV transfer, so that
// a later turn's prefill pulls the KV the decode engine kept from the turn
// before instead of recomputing the whole history.
//
// # The turn
//
// Router.Do runs one turn in five steps:
//
//  1. Pick: the Identifier gives the retention keys the request may
//     continue, most specific first; the first handle found is taken from
//     the Store (atomically: a handle goes to at most one prefill request,
//     ever) and the threshold.Policy decides whether attaching it is worth
//     a pull. A Selector picks the prefill engine.
//  2. Prefill: the client's body goes to P with stream false, max_tokens 1,
//     max_completion_tokens, min_tokens, min_completion_tokens and
//     stream_options removed, and kv_transfer_params set to the retained
//     decode handle (role flags forced: do_remote_decode true,
//     do_remote_prefill false; every other key byte for byte) or, on a miss,
//     the miss handle. P answers one token and its own handle.
//  3. Decode: at once, the client's body goes to D with P's handle. The
//     decode engine that held the retained KV is preferred: its own prefix
//     cache still covers the conversation. The miss handle never reaches D.
//  4. Capture: D's answer is handed to the caller with every
//     kv_transfer_params removed and all other bytes untouched, event by
//     event for a stream. D's handle is read from a non-streaming body or
//     from a stream's final chunk (engines with vLLM PR #40186; stock
//     engines send none in streams, which is logged once and counted).
//  5. Store: when the turn ended normally (finish_reason stop or length, the
//     stream complete), the handle is retained under the key the Identifier
//     derives from the request and the reply, for the retention TTL.
//
// Both legs carry the same X-Request-Id (the client's, or a generated one)
// and are built from the caller's context: a client that goes away cancels
// the prefill request or aborts the decode stream, and the engine frees its
// blocks. The router's own body fields (conversation_id) and any
// client-supplied kv_transfer_params are never forwarded; neither is the
// client's Authorization header.
//
// # Embedding
//
// A Router is an http.Handler for POST /v1/chat/completions and
// /v1/completions. Services that want the stream themselves call Do and
// read Response.Next, or Response.WriteTo. Options configure endpoints,
// the Store (retention.Memory by default; retention/redisstore shares
// handles across replicas), the TTL, the threshold, timeouts, the logger,
// an Observer for metrics, and the Identifier.
//
// # Errors
//
// Errors before any response byte reach an HTTP client in OpenAI's JSON
// error shape: 400 for a malformed request (ErrBadRequest), an engine's own
// 4xx passed through, 502 for a failed upstream leg (*UpstreamError names
// the phase, the endpoint and the status), 503 when no endpoint is
// available, 504 on a timeout. A prefill leg that fails on a connection
// error or with 502/503/504 is retried on another engine with backoff; if
// the failed attempt carried a retained handle, the handle is spent and
// every retry is a plain miss, so the turn still gets a correct answer. If P
// answers without a handle the turn fails with 502, or, with
// WithLocalPrefillFallback, D prefills by itself. Once a stream has started,
// an error can only end it: ServeHTTP writes an SSE event
// data: {"error":{...}} and closes the connection without data: [DONE], and
// nothing is retained. A Store failure never fails a turn: it is a miss.
//
// # Concurrency
//
// A Router is safe for concurrent use. Close stops its background work;
// turns in flight finish.
package kvroute
