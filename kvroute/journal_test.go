package kvroute_test

import (
	"net/http/httputil"
	"net/url"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention/budget"
)

// processes are router replicas as in separate processes: one Store
// (Redis, in production) and one DecodeMemory.Journal shared, each with a
// ledger of its own, over a 1P1D cluster on a virtual clock.
type processes struct {
	*replicas
	ledgers []*budget.Budget
	journal *budget.MemoryJournal
}

func startProcesses(t *testing.T, n, blocks int, mem kvroute.DecodeMemory) *processes {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk),
		kvroutetest.WithNumBlocks(blocks))
	u, err := url.Parse(c.Prefill[0].URL())
	require.NoError(t, err)
	g := &processes{replicas: &replicas{c: c, d: c.Decode[0], front: &releaseFront{proxy: httputil.NewSingleHostReverseProxy(u)},
		rec: &kvroutetest.Records{}}, journal: &budget.MemoryJournal{}}
	p := newServer(t, g.front)
	store := newClockStore(t, clk)
	mem.Journal = g.journal
	for range n {
		l, err := budget.New()
		require.NoError(t, err)
		mem.Ledger = l
		r, err := kvroute.New(kvroute.WithPrefill(p), kvroute.WithDecode(g.d.URL()), kvroute.WithClock(clk.Now),
			kvroute.WithStore(store), kvroute.WithObserver(g.rec), kvroute.WithDecodeMemory(mem))
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() })
		g.routers, g.srvs = append(g.routers, r), append(g.srvs, serve(t, r))
		g.ledgers = append(g.ledgers, l)
	}
	for _, r := range g.routers {
		knowCapacity(t, r)
	}
	return g
}

// converge waits, boundedly (the ledgers sync every second of wall
// time), until every process's ledger counts what D pins.
func (g *processes) converge(t *testing.T) {
	t.Helper()
	want := int64(0)
	for range 10_000 {
		want = int64(g.d.Stats().BlocksPinned * 16)
		if g.views() == [2]int64{want, 0} {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Errorf("the ledgers never converged: views %v, D pins %d tokens", g.views(), want)
}

// Routers in separate processes, each with its own ledger, sharing a
// Store and a Journal count each hold once, whichever process retained
// it: with each conversation's turns alternating between them, every
// process's ledger counts what D pins, has one hold a conversation, and
// observed every return (the same pauses learned).
func TestJournalProcessesCountEachHold(t *testing.T) {
	g := startProcesses(t, 2, 1024, kvroute.DecodeMemory{Budget: 0.5}) // nothing is released
	var convs []*conversation
	for i := range 3 {
		convs = append(convs, g.conv(i))
	}
	turns := 0
	for turn := range 3 {
		for i, conv := range convs {
			g.turn(t, (i+turn)%2, conv, turn)
			turns++
			g.converge(t)
			require.Positive(t, g.d.Stats().BlocksPinned)
		}
	}
	for _, l := range g.ledgers { // the last turn's return, synced
		for i := 0; i < 5000 && l.Stats().Returned < int64(turns-len(convs)); i++ {
			time.Sleep(time.Millisecond)
		}
	}
	for k, l := range g.ledgers {
		s := l.Stats()
		assert.Equal(t, len(convs), s.Holds, "one hold a conversation, in process %d's ledger", k)
		assert.EqualValues(t, turns-len(convs), s.Returned, "every return, through either process: %d", k)
		assert.Positive(t, s.Journal.Applied, k)
		assert.Zero(t, s.Journal.Errors+s.Journal.Dropped, k)
	}
	assert.Zero(t, g.sum(requested)+g.sum(func(s kvroute.Stats) int64 { return s.ReleaseGone }))
	assert.Zero(t, g.d.Stats().WrongOutputs)
}

// A process makes room on an engine by releasing a hold another process
// retained: B's decode leg does not fit beside A's hold, B's ledger
// counts that hold (read from the journal) and B releases it, once; A's
// ledger then counts nothing, and both count what D pins.
func TestJournalProcessReleasesOthersHold(t *testing.T) {
	g := startProcesses(t, 2, budgetBlocks, kvroute.DecodeMemory{Budget: 1})
	a, b := 0, 1
	g.turn(t, a, g.conv(0), 0)
	g.converge(t)
	kv := g.routers[b].DecodeKV()[0]
	require.Positive(t, kv.HeldTokens, "B counts A's hold")
	limit := kv.Capacity * 95 / 100 // the default Headroom, 0.05
	conv := g.conv(1)
	conv.say(userText(0))
	ref, err := kvroutetest.Reference(conv.path, conv.body())
	require.NoError(t, err)
	// B's leg fits alone, not beside A's hold.
	conv.maxTok = int(limit-int64(ref.PromptTokens)) - 32
	require.Greater(t, int64(ref.PromptTokens+conv.maxTok)+kv.HeldTokens, limit)
	roomTurn(t, g.c, g.srvs[b], conv)
	// B's release, then A's sync (every second of wall time).
	for i := 0; i < 10_000 && (g.routers[b].Stats().ReleasedRoom == 0 || g.ledgers[a].Stats().Ended == 0); i++ {
		time.Sleep(time.Millisecond)
	}
	g.converge(t)
	sa, sb := g.routers[a].Stats(), g.routers[b].Stats()
	assert.EqualValues(t, 1, sb.ReleasedRoom, "B released A's hold")
	assert.Zero(t, requested(sa))
	assert.EqualValues(t, 1, g.front.releases.Load(), "one release request")
	assert.Zero(t, sa.ReleaseGone+sb.ReleaseGone+sa.ReleaseFailures+sb.ReleaseFailures)
	for k, l := range g.ledgers {
		s := l.Stats()
		assert.Equal(t, 1, s.Holds, "only B's new hold, in process %d's ledger", k)
		assert.EqualValues(t, 1, s.Released+s.Ended, "A's hold ended once: %d", k)
	}
	st := g.d.Stats()
	assert.Zero(t, st.StaleNotifies)
	assert.Zero(t, st.WrongOutputs)
}
