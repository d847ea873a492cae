package redisstore

import (
	"context"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"
)

// Stats counts a Store's calls since it was created.
type Stats struct {
	// Hits counts Takes that returned a value.
	Hits int64
	// Misses counts Takes that found no value.
	Misses int64
	// Puts counts values stored.
	Puts int64
	// TakeErrors counts Takes that failed because Redis failed, was
	// unreachable or did not answer within the per-call timeout.
	TakeErrors int64
	// PutErrors counts Puts that failed for the same reasons.
	PutErrors int64
	// Unreplicated counts Takes that removed a value and returned
	// [ErrNotReplicated] instead (see [WithWaitReplicas]); they are counted
	// in TakeErrors too.
	Unreplicated int64
	// Rejected counts Puts refused without reaching Redis: ttl <= 0 or a
	// value over the size bound.
	Rejected int64
	// Canceled counts calls cut short by the caller's context; they are not
	// Redis failures.
	Canceled int64

	// Outages counts outages started: a failed call while Redis was
	// answering starts one (see [WithRecoveryWindow] for when it ends).
	Outages int64
	// OutageFailedCalls counts the failed calls of the current outage so
	// far; 0 when Redis is answering.
	OutageFailedCalls int64
	// OutageSince is when the current outage started; the zero Time when
	// Redis is answering.
	OutageSince time.Time
	// LastOutageFailedCalls counts the failed calls of the last outage that
	// ended; 0 before any has.
	LastOutageFailedCalls int64
	// LastOutageDuration is how long the last outage that ended lasted,
	// from its first failed call to the first successful call after its
	// last failed one; 0 before any has ended.
	LastOutageDuration time.Duration
}

type counters struct {
	hits, misses, puts, takeErrors, putErrors, rejected, canceled, unreplicated atomic.Int64
}

// Stats returns the Store's counters. Each is read atomically; together
// they are a near-instant snapshot, not a transaction.
func (s *Store) Stats() Stats {
	c := &s.counters
	st := Stats{
		Hits:         c.hits.Load(),
		Misses:       c.misses.Load(),
		Puts:         c.puts.Load(),
		TakeErrors:   c.takeErrors.Load(),
		PutErrors:    c.putErrors.Load(),
		Rejected:     c.rejected.Load(),
		Unreplicated: c.unreplicated.Load(),
		Canceled:     c.canceled.Load(),
	}
	s.health.stats(&st)
	return st
}

// health tells outages from single failures, logging an outage once when
// it starts and once when it ends however many calls fail in between, and
// however the calls that fail and those that succeed interleave.
//
// An outage starts at a failed call while up, and ends at the first
// successful call at least recovery after the outage's last failed call.
type health struct {
	log      *slog.Logger
	recovery time.Duration
	now      func() time.Time // time.Now; tests in this package replace it

	down atomic.Bool // an outage is under way; read without mu on every success

	mu       sync.Mutex
	outages  int64
	failures int64     // failed calls in the current outage
	since    time.Time // first failed call of the current outage
	lastFail time.Time // last failed call of the current outage
	answered time.Time // first success after lastFail, zero if none yet
	lastN    int64     // failed calls of the last outage that ended
	lastDur  time.Duration
}

// fail records a failed call, logging when it starts an outage.
func (h *health) fail(ctx context.Context, op string, err error) {
	h.mu.Lock()
	now := h.now()
	if h.down.Load() {
		h.failures++
		h.lastFail = now
		h.answered = time.Time{}
		h.mu.Unlock()
		return
	}
	h.down.Store(true)
	h.outages++
	h.failures = 1
	h.since, h.lastFail, h.answered = now, now, time.Time{}
	h.mu.Unlock()

	msg := err.Error()
	if unknownCommand(err) {
		msg = "unknown command" // Redis quotes the arguments, the key among them
	}
	h.log.LogAttrs(ctx, slog.LevelWarn, "redisstore: redis failing; takes miss and puts are dropped until it answers again",
		slog.String("op", op), slog.String("err", msg))
}

// ok records a successful call, logging when it ends an outage. While up it
// is one atomic load.
func (h *health) ok(ctx context.Context) {
	if !h.down.Load() {
		return
	}
	h.mu.Lock()
	if !h.down.Load() {
		h.mu.Unlock()
		return
	}
	now := h.now()
	if h.answered.IsZero() {
		h.answered = now
	}
	if now.Sub(h.lastFail) < h.recovery {
		h.mu.Unlock()
		return
	}
	n, dur := h.failures, h.answered.Sub(h.since)
	h.lastN, h.lastDur = n, dur
	h.failures = 0
	h.since, h.lastFail, h.answered = time.Time{}, time.Time{}, time.Time{}
	h.down.Store(false)
	h.mu.Unlock()

	h.log.LogAttrs(ctx, slog.LevelInfo, "redisstore: redis answering again",
		slog.Int64("failed_calls", n), slog.Duration("outage", dur))
}

func (h *health) stats(st *Stats) {
	h.mu.Lock()
	defer h.mu.Unlock()
	st.Outages = h.outages
	st.OutageFailedCalls = h.failures
	st.OutageSince = h.since
	st.LastOutageFailedCalls = h.lastN
	st.LastOutageDuration = h.lastDur
}
