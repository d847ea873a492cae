package redisstore_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
	"github.com/bidikv/bidikv/retention/redisstore"
)

var j0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// ledger is a router process's ledger on the Redis journal of its own
// Store (its own client) on srv.
func ledger(t *testing.T, srv *server, source string, opts ...redisstore.Option) (*budget.Budget, *redisstore.Journal) {
	t.Helper()
	opts = append([]redisstore.Option{redisstore.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))),
		redisstore.WithTimeout(300 * time.Millisecond)}, opts...)
	s, err := redisstore.NewFromURL(srv.URL(), opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	j := s.Journal(0)
	b, err := budget.New(budget.WithJournal(j, source), budget.WithFraction(0.5))
	require.NoError(t, err)
	return b, j
}

func syncLedgers(t *testing.T, now time.Time, bs ...*budget.Budget) {
	t.Helper()
	for range 2 {
		for _, b := range bs {
			require.NoError(t, b.Sync(context.Background(), now))
		}
	}
}

func rhold(key string, tokens int, created time.Time) budget.Hold {
	return budget.Hold{Key: key, Engine: "d", Tokens: tokens, Created: created, Expires: created.Add(450 * time.Second),
		Saved: time.Second, Features: budget.Features{Class: "c", Turn: 2}, Owner: "tenant"}
}

// Two processes' ledgers on one Redis: holds counted once on both, a
// return through one ends the other's hold (also when it comes before
// the addition is read), capacities and running requests are shared,
// the pauses learned are the same, and a process that starts later
// holds the live holds.
func TestJournalRedis(t *testing.T) {
	srv := startServer(t)
	a, _ := ledger(t, srv, "a")
	b, _ := ledger(t, srv, "b")
	a.SetCapacity("d", budget.Capacity{Tokens: 10_000, BlockSize: 16})
	for i := range 4 {
		require.NoError(t, a.Add(rhold(fmt.Sprint("a", i), 1000, j0)))
		require.NoError(t, b.Add(rhold(fmt.Sprint("b", i), 500, j0)))
	}
	a.Running("d", 700)
	now := j0.Add(time.Second)
	syncLedgers(t, now, a, b)
	ha, budgetA := a.Held("d", now)
	hb, budgetB := b.Held("d", now)
	assert.EqualValues(t, 4*1008+4*512, ha)
	assert.Equal(t, ha, hb)
	assert.EqualValues(t, 5000, budgetB, "A's capacity")
	assert.Equal(t, budgetA, budgetB)
	assert.EqualValues(t, 700, b.Running("d", 0))

	// Returns both ways; one before the addition is read.
	assert.True(t, b.Return("a0", now))
	assert.True(t, a.Return("b0", now))
	require.NoError(t, a.Add(rhold("a9", 1000, now)))
	assert.False(t, b.Return("a9", now.Add(2*time.Second)), "not read yet")
	later := now.Add(3 * time.Second)
	syncLedgers(t, later, b, a)
	for _, l := range []*budget.Budget{a, b} {
		held, _ := l.Held("d", later)
		assert.EqualValues(t, 3*1008+3*512, held)
		assert.EqualValues(t, 3, l.Stats().Returned)
	}
	assert.Equal(t, a.Snapshot(later, time.Minute).Classes[0].Returns, b.Snapshot(later, time.Minute).Classes[0].Returns)

	// Over the budget, B's victims include A's holds, once.
	v := b.Victims("d", 1000, later)
	require.NotEmpty(t, v)
	syncLedgers(t, later, b, a)
	ha, _ = a.Held("d", later)
	hb, _ = b.Held("d", later)
	assert.Equal(t, ha, hb)
	assert.LessOrEqual(t, ha, int64(4000))

	c, _ := ledger(t, srv, "c")
	syncLedgers(t, later, c)
	hc, _ := c.Held("d", later)
	assert.Equal(t, ha, hc, "a process that starts later")
	assert.EqualValues(t, 700, c.Running("d", 0))
	assert.EqualValues(t, 10_000, c.Capacity("d"))
	// A stops: its running requests stop counting after the lease.
	end := later.Add(budget.JournalLease + time.Second)
	require.NoError(t, b.Sync(context.Background(), end))
	require.NoError(t, c.Sync(context.Background(), end))
	assert.Zero(t, b.Running("d", 0))
	assert.Zero(t, c.Running("d", 0))
}

// The stream keeps the records of its window: older ones are trimmed (to
// a node of the stream: stream-node-max-entries), and a Read from the
// start begins after them.
func TestJournalRedisTrimmed(t *testing.T) {
	srv := startServer(t, "--stream-node-max-entries", "10")
	s, err := redisstore.NewFromURL(srv.URL(), redisstore.WithLogger(slog.New(slog.NewTextHandler(io.Discard, nil))))
	require.NoError(t, err)
	defer s.Close()
	j := s.Journal(50 * time.Millisecond)
	ctx := context.Background()
	old := make([][]byte, 200)
	for i := range old {
		old[i] = []byte{1, byte(i)}
	}
	require.NoError(t, j.Append(ctx, old))
	n, err := j.Len(ctx)
	require.NoError(t, err)
	require.EqualValues(t, 200, n)
	time.Sleep(150 * time.Millisecond)
	require.NoError(t, j.Append(ctx, [][]byte{{2}}))
	require.NoError(t, j.Append(ctx, [][]byte{{3}})) // trims with the newest ID seen
	n, err = j.Len(ctx)
	require.NoError(t, err)
	assert.Less(t, n, int64(20), "the records older than the window are trimmed")
	recs, _, err := j.Read(ctx, "", 1000)
	require.NoError(t, err)
	require.NotEmpty(t, recs)
	assert.Equal(t, []byte{3}, recs[len(recs)-1])
	assert.Equal(t, []byte{2}, recs[len(recs)-2])
}

// A Redis that goes away: Sync fails, counted, within the store's
// timeout; the ledger's own calls (a turn's) go on; what was queued is
// sent when Redis is back.
func TestJournalRedisDown(t *testing.T) {
	srv := startServer(t)
	a, ja := ledger(t, srv, "a")
	b, _ := ledger(t, srv, "b")
	syncLedgers(t, j0, a, b)
	srv.kill()
	require.NoError(t, a.Add(rhold("k", 1000, j0)))
	start := time.Now()
	err := a.Sync(context.Background(), j0.Add(time.Second))
	require.Error(t, err)
	assert.Less(t, time.Since(start), 2*time.Second, "bounded by the store's timeout")
	assert.EqualValues(t, 1, a.Stats().Journal.Errors)
	assert.Positive(t, ja.Errors())
	held, _ := a.Held("d", j0.Add(time.Second))
	assert.EqualValues(t, 1008, held, "the turn's path does not wait for Redis")
	srv.restart()
	syncLedgers(t, j0.Add(2*time.Second), a, b)
	h, ok := b.Lookup("k")
	require.True(t, ok, "the queued addition reached B")
	assert.Equal(t, 1000, h.Tokens)
	assert.Zero(t, a.Stats().Journal.Dropped)
}
