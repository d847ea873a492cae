package kvroute

import (
	"context"
	"log/slog"
	"sync/atomic"
	"time"
)

// Store retains decode handles between turns.
//
// Values are opaque bytes produced by the Router (a small header plus the
// decode engine's kv_transfer_params JSON); a Store must return them exactly
// as stored. Keys are opaque strings.
//
// Take must be atomic: among any number of concurrent and later callers, at
// most one receives a given stored value, because a decode handle may be
// attached to at most one prefill request, ever. A Store is safe for
// concurrent use.
type Store interface {
	// Put stores value under key for ttl, replacing any earlier value.
	// A ttl <= 0 is an error.
	Put(ctx context.Context, key string, value []byte, ttl time.Duration) error
	// Take removes and returns the value stored under key. ok is false
	// when there is none (never stored, expired, evicted or already taken).
	Take(ctx context.Context, key string) (value []byte, ok bool, err error)
}

// storeHealth turns Store failures into two log lines per outage: one when
// the first call fails, one when a call succeeds again, with the number of
// failed calls in between. Every failure is counted in Stats.StoreErrors.
type storeHealth struct {
	down   atomic.Bool
	failed atomic.Int64 // failures in the current outage
}

// storeFailed records a failed Store call; the turn goes on as a miss.
func (r *Router) storeFailed(ctx context.Context, op, requestID string, err error) {
	r.stats.storeErrors.Add(1)
	r.storeHealth.failed.Add(1)
	if r.storeHealth.down.Swap(true) {
		return
	}
	r.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: store failing; turns go on as plain prefills (logged once until it answers again)",
		slog.String("op", op), slog.String("request_id", requestID), slog.String("err", err.Error()))
}

// storeOK records a Store call that succeeded, ending an outage.
func (r *Router) storeOK(ctx context.Context) {
	if !r.storeHealth.down.Load() || !r.storeHealth.down.Swap(false) {
		return
	}
	r.log.LogAttrs(ctx, slog.LevelInfo, "kvroute: store answering again",
		slog.Int64("failed_calls", r.storeHealth.failed.Swap(0)))
}
