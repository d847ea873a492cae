package redisstore

import (
	"context"
	"log/slog"
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
	// Rejected counts Puts refused without reaching Redis: ttl <= 0 or a
	// value over the size bound.
	Rejected int64
	// Canceled counts calls cut short by the caller's context; they are not
	// Redis failures.
	Canceled int64
}

type counters struct {
	hits, misses, puts, takeErrors, putErrors, rejected, canceled atomic.Int64
}

// Stats returns the Store's counters. Each is read atomically; together
// they are a near-instant snapshot, not a transaction.
func (s *Store) Stats() Stats {
	c := &s.counters
	return Stats{
		Hits:       c.hits.Load(),
		Misses:     c.misses.Load(),
		Puts:       c.puts.Load(),
		TakeErrors: c.takeErrors.Load(),
		PutErrors:  c.putErrors.Load(),
		Rejected:   c.rejected.Load(),
		Canceled:   c.canceled.Load(),
	}
}

// health logs an outage once when it starts and once when it ends, however
// many calls fail in between.
type health struct {
	log      *slog.Logger
	down     atomic.Bool
	failures atomic.Int64 // failed calls in the current outage
	since    atomic.Int64 // when the current outage started, Unix nanoseconds
}

func (h *health) fail(ctx context.Context, op string, err error) {
	h.failures.Add(1)
	if h.down.CompareAndSwap(false, true) {
		h.since.Store(time.Now().UnixNano())
		msg := err.Error()
		if unknownCommand(err) {
			msg = "unknown command" // Redis quotes the arguments, the key among them
		}
		h.log.LogAttrs(ctx, slog.LevelWarn, "redisstore: redis failing; takes miss and puts are dropped until it answers again",
			slog.String("op", op), slog.String("err", msg))
	}
}

func (h *health) ok(ctx context.Context) {
	if !h.down.Load() || !h.down.CompareAndSwap(true, false) {
		return
	}
	n := h.failures.Swap(0)
	down := time.Duration(time.Now().UnixNano() - h.since.Load())
	h.log.LogAttrs(ctx, slog.LevelInfo, "redisstore: redis answering again",
		slog.Int64("failed_calls", n), slog.Duration("outage", down))
}
