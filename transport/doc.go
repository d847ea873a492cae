// Package transport is the upstream HTTP layer of the router: one tuned
// shared [http.Transport] ([NewTransport]), a [Client] that enforces
// per-phase deadlines (first byte, idle gap, total) instead of a whole-request
// timeout that would cut long decode streams, retry helpers for the prefill
// leg ([Retry], [Retryable], [RetryAfter]), header filtering for proxying
// ([CopyHeader], [RequestHeader]) and engine addresses ([Endpoint]).
//
// Everything here is safe for concurrent use except a single response body,
// which, as with net/http, belongs to one reader (it may be closed from
// another goroutine to abort it).
//
// Errors: deadlines surface as [ErrFirstByteTimeout], [ErrIdleTimeout] and
// [ErrTotalTimeout] (match them with errors.Is); a cancellation of the
// caller's context always stays matchable as [context.Canceled] and is never
// reported as one of those timeouts. Invalid settings wrap [ErrInvalidConfig],
// unparsable endpoints [ErrInvalidEndpoint].
package transport
