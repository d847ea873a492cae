package budget_test

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// replicas are Budgets sharing one MemoryJournal: the ledgers of router
// processes sharing a journal.
func replicas(t *testing.T, j budget.Journal, n int, opts ...budget.Option) []*budget.Budget {
	t.Helper()
	out := make([]*budget.Budget, n)
	for i := range out {
		b, err := budget.New(append([]budget.Option{budget.WithJournal(j, fmt.Sprint("r", i))}, opts...)...)
		require.NoError(t, err)
		out[i] = b
	}
	return out
}

// syncAll syncs every Budget twice, so that each has read what every
// other sent.
func syncAll(t *testing.T, now time.Time, bs ...*budget.Budget) {
	t.Helper()
	for range 2 {
		for _, b := range bs {
			require.NoError(t, b.Sync(context.Background(), now))
		}
	}
}

func jhold(key, engine string, tokens int, created time.Time, f budget.Features) budget.Hold {
	return budget.Hold{Key: key, Engine: engine, Tokens: tokens, Created: created, Expires: created.Add(450 * time.Second),
		Saved: time.Duration(tokens) * time.Millisecond, Features: f, Owner: "tenant"}
}

// Holds added through either process count once on both, with their
// shared prefixes counted as the adder counts them; a return through B
// ends A's hold; an end through A ends B's.
func TestJournalHoldsCountedOnce(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2, budget.WithCapacity(100_000))
	a, b := r[0], r[1]
	require.NoError(t, a.Add(jhold("k1", "d", 100, t0, budget.Features{})))
	require.NoError(t, a.Add(prefixHold("p1", family(600, 640, 1000), 640*16, t0)))
	require.NoError(t, b.Add(prefixHold("p2", family(600, 640, 5000), 640*16, t0.Add(time.Second))))
	require.NoError(t, b.Add(jhold("k2", "d", 50, t0.Add(time.Second), budget.Features{})))
	now := t0.Add(2 * time.Second)
	syncAll(t, now, a, b)
	ha, _ := a.Held("d", now)
	hb, _ := b.Held("d", now)
	assert.Equal(t, ha, hb, "both ledgers count the same holds")
	assert.Less(t, ha, int64(112+2*640*16+64), "the shared prefix counted once")
	assert.Greater(t, ha, int64(112+640*16))
	assert.Equal(t, 4, a.Stats().Holds)
	assert.Equal(t, 4, b.Stats().Holds)

	assert.True(t, b.Return("k1", now), "B sees A's hold live")
	assert.True(t, a.End("k2", now), "A sees B's hold live")
	syncAll(t, now, a, b)
	_, live := a.Lookup("k1")
	assert.False(t, live, "B's return ended A's hold")
	_, live = b.Lookup("k2")
	assert.False(t, live, "A's end ended B's hold")
	ha, _ = a.Held("d", now)
	hb, _ = b.Held("d", now)
	assert.Equal(t, ha, hb)
	assert.Equal(t, 2, a.Stats().Holds)
	assert.Equal(t, 2, b.Stats().Holds)
	assert.EqualValues(t, 1, a.Stats().Returned)
	assert.EqualValues(t, 1, b.Stats().Returned)
}

// A return that comes before the hold's addition (B found the handle in
// the store before A's Sync sent the addition) ends the hold on both,
// observed once on each, and the new hold B retains under the key in the
// same turn is the only one counted.
func TestJournalReturnBeforeAdd(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2, budget.WithCapacity(100_000))
	a, b := r[0], r[1]
	f := budget.Features{Class: "x", Turn: 2}
	require.NoError(t, a.Add(jhold("k", "d", 320, t0, f)))
	back := t0.Add(20 * time.Second)
	assert.False(t, b.Return("k", back), "B has not read A's addition")
	require.NoError(t, b.Add(jhold("k", "d", 400, back.Add(time.Second), budget.Features{Class: "x", Turn: 3})))
	require.NoError(t, b.Sync(context.Background(), back)) // B's return and addition first
	now := back.Add(2 * time.Second)
	syncAll(t, now, a, b)
	for i, l := range []*budget.Budget{a, b} {
		h, ok := l.Lookup("k")
		require.True(t, ok, i)
		assert.Equal(t, 400, h.Tokens, "only B's new hold: %d", i)
		held, _ := l.Held("d", now)
		assert.EqualValues(t, 400, held, i)
		assert.EqualValues(t, 1, l.Stats().Returned, "the return observed once: %d", i)
	}
	assert.Zero(t, b.Stats().Journal.Pending, "A's addition ended the pending return")
	sa, sb := a.Snapshot(now, time.Minute), b.Snapshot(now, time.Minute)
	assertSnapshots(t, sa, sb)
	assert.Greater(t, sa.Classes[0].Returns, 0.0)

	// A third process reads B's return before A's addition.
	c := replicas(t, j, 3)[2]
	syncAll(t, now, c)
	held, _ := c.Held("d", now)
	assert.EqualValues(t, 400, held, "a process that starts reads the same")
	assert.EqualValues(t, 1, c.Stats().Returned, "B's return, read before A's addition, ended it there too")
	assertSnapshots(t, sa, c.Snapshot(now, time.Minute))
}

func assertSnapshots(t *testing.T, a, b budget.Snapshot) {
	t.Helper()
	require.Len(t, b.Classes, len(a.Classes))
	for i := range a.Classes {
		ca, cb := a.Classes[i], b.Classes[i]
		assert.Equal(t, ca.Class, cb.Class)
		assert.InDelta(t, ca.Observations, cb.Observations, 1e-9*(1+ca.Observations), ca.Class)
		assert.InDelta(t, ca.Returns, cb.Returns, 1e-9*(1+ca.Returns), ca.Class)
		assert.InDelta(t, ca.Open, cb.Open, 1e-9*(1+ca.Open), ca.Class)
		assert.InDelta(t, ca.Return, cb.Return, 1e-6, ca.Class)
		// Quantiles read off sums in another order may differ in the last
		// bits: equal within a millisecond, not rounded to one (a value on
		// a rounding boundary would flip).
		assert.InDelta(t, ca.P50, cb.P50, float64(time.Millisecond), ca.Class)
		assert.InDelta(t, ca.P90, cb.P90, float64(time.Millisecond), ca.Class)
	}
}

// Conversations spread across two processes (each turn through either,
// as a load balancer sends them; both Sync every second, as kvroute's
// runner does), with returns, victims and expiries: both ledgers hold the
// same holds and learn the same pauses. (A conversation's next turn
// through the other process within a Sync or two of the last, which that
// process has not read yet, is observed there as a pause of the hold
// before: the pauses differ by that much. Here turns are 3 s apart at
// least.)
func TestJournalModelSame(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2, budget.WithCapacity(40_000), budget.WithGrace(30*time.Second))
	rng := rand.New(rand.NewPCG(1, 2))
	next := map[string]time.Time{} // each conversation's next turn
	turn := map[string]int{}
	for i := range 60 {
		next[fmt.Sprint("c", i)] = t0.Add(time.Duration(rng.IntN(60_000)) * time.Millisecond)
	}
	now := t0
	for tick := range 3600 * 10 {
		now = t0.Add(time.Duration(tick) * 100 * time.Millisecond)
		// In key order, so that a run repeats (a map's order does not).
		for _, key := range slices.Sorted(maps.Keys(next)) {
			if next[key].After(now) {
				continue
			}
			l := r[rng.IntN(2)]
			l.Return(key, now)
			turn[key]++
			f := budget.Features{Class: fmt.Sprint("t", len(key)%3), Turn: turn[key], ToolCalls: rng.IntN(3) == 0}
			require.NoError(t, l.Add(jhold(key, "d", 100+rng.IntN(4000), now, f)))
			pause := time.Duration(3000+rng.IntN(1000)) * time.Millisecond
			if !f.ToolCalls {
				pause = time.Duration(rng.ExpFloat64() * float64(3*time.Minute))
				pause = max(pause, 3000*time.Millisecond)
			}
			next[key] = now.Add(pause)
			if rng.IntN(4) == 0 { // the conversation ends; another starts
				delete(next, key)
				k := fmt.Sprint("c", tick, key)
				next[k] = now.Add(time.Duration(rng.IntN(60_000)) * time.Millisecond)
			}
		}
		if tick%10 == 0 {
			for _, l := range r {
				require.NoError(t, l.Sync(context.Background(), now))
				l.Expired("d", now)
			}
			if rng.IntN(5) == 0 {
				r[rng.IntN(2)].Victims("d", 0, now)
			}
		}
	}
	syncAll(t, now, r...)
	ha, _ := r[0].Held("d", now)
	hb, _ := r[1].Held("d", now)
	assert.Equal(t, ha, hb)
	assert.Equal(t, r[0].Stats().Holds, r[1].Stats().Holds)
	assert.Greater(t, ha, int64(0))
	assert.Greater(t, r[0].Stats().Released+r[1].Stats().Released, int64(10))
	sa, sb := r[0].Snapshot(now, time.Minute), r[1].Snapshot(now, time.Minute)
	assertSnapshots(t, sa, sb)
	assert.Greater(t, sa.Classes[0].Returns, 1000.0*0.5)
}

// The running tokens of a process count in the others' Running until its
// lease ends: a process that stops reporting stops counting.
func TestJournalRunningLease(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2)
	a, b := r[0], r[1]
	a.Running("d", 300)
	b.Running("d", 20)
	syncAll(t, t0, a, b)
	assert.EqualValues(t, 320, a.Running("d", 0))
	assert.EqualValues(t, 320, b.Running("d", 0))
	assert.Equal(t, 1, b.Stats().Journal.Sources)
	a.Running("d", -100)
	syncAll(t, t0.Add(time.Second), a, b)
	assert.EqualValues(t, 220, b.Running("d", 0), "the change is reported")
	// A stops syncing (it died): B counts its requests until the lease
	// from A's last report ends.
	require.NoError(t, b.Sync(context.Background(), t0.Add(budget.JournalLease/2)))
	assert.EqualValues(t, 220, b.Running("d", 0))
	require.NoError(t, b.Sync(context.Background(), t0.Add(time.Second+budget.JournalLease)))
	assert.EqualValues(t, 20, b.Running("d", 0), "A's lease ended")
	assert.Zero(t, b.Stats().Journal.Sources)
	// A live process reports again within the lease.
	a.Running("d", 0)
	for s := 12; s < 40; s++ {
		now := t0.Add(time.Duration(s) * time.Second)
		syncAll(t, now, a, b)
		require.EqualValues(t, 220, b.Running("d", 0), s)
	}
}

// A capacity one process reads is every process's: the budget applies on
// both.
func TestJournalCapacity(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2, budget.WithFraction(0.5))
	a, b := r[0], r[1]
	a.SetCapacity("d", budget.Capacity{Tokens: 8000, BlockSize: 32})
	syncAll(t, t0, a, b)
	assert.EqualValues(t, 8000, b.Capacity("d"))
	assert.Equal(t, 32, b.BlockSize("d"))
	_, budgetB := b.Held("d", t0)
	assert.EqualValues(t, 4000, budgetB)
	// Over it, B's victims include A's holds.
	require.NoError(t, a.Add(jhold("a", "d", 3000, t0, budget.Features{})))
	require.NoError(t, b.Add(jhold("b", "d", 3000, t0, budget.Features{})))
	syncAll(t, t0, a, b)
	v := b.Victims("d", 0, t0.Add(time.Second))
	require.Len(t, v, 1)
	syncAll(t, t0.Add(time.Second), a, b)
	ha, _ := a.Held("d", t0.Add(time.Second))
	hb, _ := b.Held("d", t0.Add(time.Second))
	assert.Equal(t, ha, hb)
	assert.EqualValues(t, 3008, ha, "one hold released, on both")
}

// A process that starts later reads the journal kept and holds the live
// holds, not those already returned or ended.
func TestJournalLateStart(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2)
	a, b := r[0], r[1]
	for i := range 20 {
		require.NoError(t, a.Add(jhold(fmt.Sprint("k", i), "d", 100, t0.Add(time.Duration(i)*time.Second), budget.Features{})))
	}
	now := t0.Add(30 * time.Second)
	syncAll(t, now, a, b)
	for i := range 5 {
		b.Return(fmt.Sprint("k", i), now)
		a.End(fmt.Sprint("k", 10+i), now)
	}
	syncAll(t, now, a, b)
	c := replicas(t, j, 3)[2]
	syncAll(t, now, c)
	hc, _ := c.Held("d", now)
	ha, _ := a.Held("d", now)
	assert.Equal(t, ha, hc)
	assert.Equal(t, 10, c.Stats().Holds)
	_, live := c.Lookup("k19")
	assert.True(t, live)
	_, live = c.Lookup("k0")
	assert.False(t, live)
}

// A journal that goes away: Sync fails and counts it, the ledger's own
// calls go on, and the changes queued meanwhile are sent when it comes
// back.
func TestJournalDown(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2)
	a, b := r[0], r[1]
	j.Fail(errors.New("down"))
	require.NoError(t, a.Add(jhold("k", "d", 100, t0, budget.Features{})))
	err := a.Sync(context.Background(), t0)
	require.Error(t, err)
	assert.ErrorContains(t, err, "down")
	assert.EqualValues(t, 1, a.Stats().Journal.Errors)
	assert.True(t, a.Return("k", t0.Add(time.Second)), "the ledger works without its journal")
	require.NoError(t, a.Add(jhold("k", "d", 200, t0.Add(time.Second), budget.Features{})))
	j.Fail(nil)
	syncAll(t, t0.Add(2*time.Second), a, b)
	h, ok := b.Lookup("k")
	require.True(t, ok)
	assert.Equal(t, 200, h.Tokens)
	assert.Zero(t, a.Stats().Journal.Dropped)
	assert.EqualValues(t, 3, a.Stats().Journal.Appended, "two additions, a return")
	assert.True(t, a.Stats().Journal.Synced.Equal(t0.Add(2*time.Second)))
}

// A record that cannot be decoded is skipped and counted.
func TestJournalInvalid(t *testing.T) {
	j := &budget.MemoryJournal{}
	require.NoError(t, j.Append(context.Background(), [][]byte{{1, 1, 200}, {9}, nil}))
	b := replicas(t, j, 1)[0]
	require.NoError(t, b.Sync(context.Background(), t0))
	assert.EqualValues(t, 3, b.Stats().Journal.Invalid)
}

// Where a turn was prefilled goes through the journal too: a hold A added
// and recorded, released by B's Victims, sends its conversation's next
// turn to that prefill engine through either process; one not released
// sends it nowhere on either.
func TestJournalPrefilled(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2, budget.WithFraction(1))
	a, b := r[0], r[1]
	now := t0
	for _, l := range r {
		l.SetCapacity("d", budget.Capacity{Tokens: 4000})
	}
	old, fresh := now.Add(-400*time.Second), now.Add(-time.Second)
	require.NoError(t, a.Add(jhold("old", "d", 1000, old, budget.Features{Class: "c", Turn: 1})))
	a.SetPrefilled("old", "http://p0", now)
	require.NoError(t, a.Add(jhold("new", "d", 1000, fresh, budget.Features{Class: "c", Turn: 1})))
	a.SetPrefilled("new", "http://p1", now)
	syncAll(t, now, a, b)
	assert.Empty(t, b.Prefilled("old", now), "not released yet")
	var got []string
	for _, v := range b.Victims("d", 2500, now) {
		got = append(got, v.Key)
	}
	require.Equal(t, []string{"old"}, got)
	later := now.Add(time.Second)
	syncAll(t, later, a, b)
	assert.Equal(t, "http://p0", a.Prefilled("old", later), "A reads B's release")
	assert.Equal(t, "http://p0", b.Prefilled("old", later), "B reads A's record")
	assert.Empty(t, a.Prefilled("new", later), "live: no record on A")
	assert.Empty(t, b.Prefilled("new", later), "live: no record on B")
}

// A placement recorded by one process is read by another with its decode
// engine, and its writes age the other's records of that engine.
func TestJournalPlaced(t *testing.T) {
	j := &budget.MemoryJournal{}
	r := replicas(t, j, 2, budget.WithFraction(1))
	a, b := r[0], r[1]
	now := t0
	b.SetPlaced("first", budget.Placement{Decode: "http://d", Tokens: 4000}, now)
	a.SetPlaced("k", budget.Placement{Prefill: "http://p", Decode: "http://d", Tokens: 8000, Prior: "first"}, now)
	syncAll(t, now, a, b)
	p, after, ok := b.Placed("k", now)
	require.True(t, ok, "B reads A's record")
	assert.Equal(t, budget.Placement{Prefill: "http://p", Decode: "http://d", Tokens: 8000}, p)
	assert.Zero(t, after)
	_, after, ok = b.Placed("first", now)
	require.True(t, ok)
	assert.EqualValues(t, 8000, after, "A's turn on d ages B's record")
	b.SetPlaced("other", budget.Placement{Decode: "http://d", Tokens: 1000}, now)
	a.SetPlaced("k2", budget.Placement{Decode: "http://d", Tokens: 9000, Prior: "k"}, now)
	syncAll(t, now, a, b)
	_, after, _ = b.Placed("first", now)
	assert.EqualValues(t, 10000, after, "k's turns count once across processes: k2's 9,000 and other's 1,000")
	assert.Empty(t, b.Prefilled("k", now), "not released")
}
