package redisstore

import (
	"context"
	"errors"
	"log/slog"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// records is a slog.Handler that keeps every record.
type records struct {
	mu  sync.Mutex
	all []slog.Record
}

func (r *records) Enabled(context.Context, slog.Level) bool { return true }
func (r *records) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.all = append(r.all, rec.Clone())
	return nil
}
func (r *records) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *records) WithGroup(string) slog.Handler      { return r }

func (r *records) get() []slog.Record {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]slog.Record(nil), r.all...)
}

func attr(rec slog.Record, key string) slog.Value {
	var v slog.Value
	rec.Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value
			return false
		}
		return true
	})
	return v
}

// fakeHealth returns a health on a clock the test moves by hand.
func fakeHealth(recovery time.Duration) (*health, *records, *time.Time) {
	now := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	rec := &records{}
	h := &health{log: slog.New(rec), recovery: recovery, now: func() time.Time { return now }}
	return h, rec, &now
}

func healthStats(h *health) Stats {
	var st Stats
	h.stats(&st)
	return st
}

// TestHealthFlapping alternates failed and successful calls, as a Redis
// whose writes fail (out of memory, a read-only replica) while its reads
// answer does on every turn: one record when it starts, none per flap, one
// when calls have succeeded for the recovery window.
func TestHealthFlapping(t *testing.T) {
	h, rec, now := fakeHealth(time.Second)
	ctx := t.Context()
	oom := errors.New("OOM command not allowed when used memory > 'maxmemory'.")
	start := *now
	for range 1000 {
		h.fail(ctx, opPut, oom)
		*now = now.Add(time.Millisecond)
		h.ok(ctx)
		*now = now.Add(time.Millisecond)
	}
	recs := rec.get()
	require.Len(t, recs, 1, "one record for the whole outage so far")
	assert.Equal(t, slog.LevelWarn, recs[0].Level)
	assert.Equal(t, oom.Error(), attr(recs[0], "err").String())
	assert.Equal(t, opPut, attr(recs[0], "op").String())
	st := healthStats(h)
	assert.Equal(t, int64(1), st.Outages)
	assert.Equal(t, int64(1000), st.OutageFailedCalls)
	assert.Equal(t, start, st.OutageSince)

	// Successes within the window after the last failure do not end it.
	lastFail := now.Add(-2 * time.Millisecond)
	firstOK := now.Add(-time.Millisecond)
	for range 10 {
		*now = now.Add(50 * time.Millisecond)
		h.ok(ctx)
	}
	require.Len(t, rec.get(), 1)
	*now = lastFail.Add(time.Second)
	h.ok(ctx)
	recs = rec.get()
	require.Len(t, recs, 2)
	assert.Equal(t, slog.LevelInfo, recs[1].Level)
	assert.Equal(t, "redisstore: redis answering again", recs[1].Message)
	assert.Equal(t, int64(1000), attr(recs[1], "failed_calls").Int64())
	assert.Equal(t, firstOK.Sub(start), attr(recs[1], "outage").Duration(),
		"the outage runs to the first success after the last failure")
	assert.Equal(t, Stats{Outages: 1, LastOutageFailedCalls: 1000, LastOutageDuration: firstOK.Sub(start)}, healthStats(h))

	// A later failure starts a second outage.
	h.ok(ctx)
	h.fail(ctx, opTake, errors.New("connection refused"))
	recs = rec.get()
	require.Len(t, recs, 3)
	assert.Equal(t, slog.LevelWarn, recs[2].Level)
	assert.Equal(t, int64(2), healthStats(h).Outages)
}

// TestHealthFailureResetsRecovery checks that a failure during the window
// restarts it.
func TestHealthFailureResetsRecovery(t *testing.T) {
	h, rec, now := fakeHealth(time.Second)
	ctx := t.Context()
	h.fail(ctx, opTake, errors.New("down"))
	*now = now.Add(900 * time.Millisecond)
	h.ok(ctx)
	h.fail(ctx, opTake, errors.New("down"))
	*now = now.Add(900 * time.Millisecond)
	h.ok(ctx)
	assert.Len(t, rec.get(), 1)
	*now = now.Add(100 * time.Millisecond)
	h.ok(ctx)
	recs := rec.get()
	require.Len(t, recs, 2)
	assert.Equal(t, int64(2), attr(recs[1], "failed_calls").Int64())
	assert.Equal(t, 1800*time.Millisecond, attr(recs[1], "outage").Duration())
}

// TestHealthZeroWindow ends an outage at the first success.
func TestHealthZeroWindow(t *testing.T) {
	h, rec, now := fakeHealth(0)
	ctx := t.Context()
	h.fail(ctx, opTake, errors.New("down"))
	h.fail(ctx, opPut, errors.New("down"))
	*now = now.Add(time.Second)
	h.ok(ctx)
	h.ok(ctx)
	recs := rec.get()
	require.Len(t, recs, 2)
	assert.Equal(t, int64(2), attr(recs[1], "failed_calls").Int64())
	assert.Equal(t, time.Second, attr(recs[1], "outage").Duration())
}

// TestHealthConcurrent fails and succeeds from many goroutines at once:
// one outage, every failure counted, one record each way.
func TestHealthConcurrent(t *testing.T) {
	rec := &records{}
	h := &health{log: slog.New(rec), recovery: time.Hour, now: time.Now}
	ctx := t.Context()
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for range 1000 {
				h.fail(ctx, opTake, errors.New("down"))
				h.ok(ctx)
			}
		})
	}
	wg.Wait()
	assert.Len(t, rec.get(), 1)
	assert.Equal(t, int64(8000), healthStats(h).OutageFailedCalls)
	h.recovery = 0 // no call runs now
	h.ok(ctx)
	recs := rec.get()
	require.Len(t, recs, 2)
	assert.Equal(t, int64(8000), attr(recs[1], "failed_calls").Int64())
}
