package kvroute

import (
	"context"
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
