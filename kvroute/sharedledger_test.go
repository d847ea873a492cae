package kvroute_test

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
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

// replicas are router replicas in one process over a 1P1D cluster on a
// virtual clock: they share one Store (entries expire on the clock) and
// one DecodeMemory.Ledger, with the prefill engine behind a releaseFront.
type replicas struct {
	c       *kvroutetest.Cluster
	d       *kvroutetest.Engine
	routers []*kvroute.Router
	srvs    []string
	ledger  *budget.Budget
	front   *releaseFront
	rec     *kvroutetest.Records // every replica's turns
}

// newReplicas starts n replicas over a decode engine of blocks blocks of
// 16 tokens, each with a budget of half of it.
func newReplicas(t *testing.T, n, blocks int) *replicas {
	return startReplicas(t, n, blocks, kvroute.DecodeMemory{Budget: 0.5}, nil)
}

// startReplicas is newReplicas with the replicas' DecodeMemory (given the
// shared Ledger) and, when gate is not nil, the decode engine behind it.
func startReplicas(t *testing.T, n, blocks int, mem kvroute.DecodeMemory, gate *legGate) *replicas {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk),
		kvroutetest.WithNumBlocks(blocks))
	u, err := url.Parse(c.Prefill[0].URL())
	require.NoError(t, err)
	g := &replicas{c: c, d: c.Decode[0], front: &releaseFront{proxy: httputil.NewSingleHostReverseProxy(u)}, rec: &kvroutetest.Records{}}
	p := newServer(t, g.front)
	store := newClockStore(t, clk)
	g.ledger, err = budget.New()
	require.NoError(t, err)
	mem.Ledger = g.ledger
	d := g.d.URL()
	if gate != nil {
		u, err := url.Parse(d)
		require.NoError(t, err)
		gate.proxy = httputil.NewSingleHostReverseProxy(u)
		d = newServer(t, gate)
	}
	for range n {
		r, err := kvroute.New(kvroute.WithPrefill(p), kvroute.WithDecode(d), kvroute.WithClock(clk.Now),
			kvroute.WithStore(store), kvroute.WithObserver(g.rec), kvroute.WithDecodeMemory(mem))
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() })
		g.routers, g.srvs = append(g.routers, r), append(g.srvs, serve(t, r))
	}
	for _, r := range g.routers {
		knowCapacity(t, r)
	}
	return g
}

// conv is conversation i, whose system prompt is its own (D's prefix
// cache shares no block between two conversations' holds).
func (g *replicas) conv(i int) *conversation {
	return &conversation{path: kvroute.PathChatCompletions, maxTok: 16,
		messages: []message{{Role: "system", Content: fmt.Sprintf("Agent %d. %s", i, systemPrompt)}}}
}

// turn sends conv's next turn through replica k and checks its answer
// against a single engine's.
func (g *replicas) turn(t *testing.T, k int, conv *conversation, turn int) {
	t.Helper()
	conv.say(userText(turn))
	conv.hear(releaseTurn(t, g.srvs[k], conv.path, conv.body(), nil))
}

// sum adds up the replicas' Stats fields that f picks.
func (g *replicas) sum(f func(kvroute.Stats) int64) int64 {
	var n int64
	for _, r := range g.routers {
		n += f(r.Stats())
	}
	return n
}

// settled reports whether every hold the ledger chose to release has its
// release's outcome counted, by whichever replica chose it, and the
// ledger fits the budget.
func (g *replicas) settled() bool {
	resolved := g.sum(func(s kvroute.Stats) int64 {
		return requested(s) + s.ReleasedExpired + s.ReleaseFailures + s.ReleaseGone + s.ReleaseSkipped
	})
	chosen := g.ledger.Stats()
	held, b := g.ledger.Held(g.routers[0].DecodeKV()[0].Endpoint, g.c.Clock.Now())
	return resolved >= chosen.Released+chosen.Expired && (b == 0 || held <= b)
}

// settle waits, boundedly, until the replicas' releases settled and every
// replica's view of the decode engine's holds is what D pins.
func (g *replicas) settle(t *testing.T) {
	t.Helper()
	for range 5000 {
		if g.settled() && g.views() == [2]int64{int64(g.d.Stats().BlocksPinned * 16), 0} {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Logf("never settled: views %v, D pins %d tokens, ledger %+v", g.views(), g.d.Stats().BlocksPinned*16, g.ledger.Stats())
}

// views is what the replicas' DecodeKV count on D, in tokens: the first
// replica's, and how far the others' differ from it at most.
func (g *replicas) views() [2]int64 {
	first := ledgerHeld(g.routers[0])
	var diff int64
	for _, r := range g.routers[1:] {
		diff = max(diff, abs(ledgerHeld(r)-first))
	}
	return [2]int64{first, diff}
}

func abs(n int64) int64 { return max(n, -n) }

// Replicas sharing one Ledger count each hold once, whichever replica
// retained it and whichever the conversation's next turn goes through:
// with each turn to the other replica, every replica's view of the
// decode engine (DecodeKV) is what D pins, after every turn; each
// conversation has one hold, and the ledger learned every return (one
// pause model).
func TestSharedLedgerCountsEachHoldOnce(t *testing.T) {
	g := newReplicas(t, 2, 1024) // a budget of 8,192 tokens: nothing is released
	var convs []*conversation
	for i := range 3 {
		convs = append(convs, g.conv(i))
	}
	turns := 0
	for turn := range 3 {
		for i, conv := range convs {
			g.turn(t, (i+turn)%2, conv, turn)
			turns++
			g.settle(t)
			pinned := int64(g.d.Stats().BlocksPinned * 16)
			require.Positive(t, pinned)
			assert.Equal(t, [2]int64{pinned, 0}, g.views(), "after turn %d of conversation %d: every replica counts what D pins", turn, i)
		}
	}
	for _, r := range g.routers {
		kv := r.DecodeKV()[0]
		assert.Equal(t, len(convs), kv.Handles, "one hold a conversation")
		assert.EqualValues(t, 8192, kv.Budget)
	}
	s := g.ledger.Stats()
	assert.EqualValues(t, turns-len(convs), s.Returned, "every return, through either replica")
	assert.Zero(t, s.Replaced)
	assert.Zero(t, g.sum(requested)+g.sum(func(s kvroute.Stats) int64 { return s.ReleaseGone }))
	assert.Zero(t, g.d.Stats().WrongOutputs)
}

// Under a budget that binds, replicas sharing one Ledger release each
// hold once and never one already used through another replica: with
// each conversation's turns alternating between them, no release finds
// its handle gone (Stats.ReleaseGone), D freed each released hold at its
// release and no other (no stale notification; every notification is a
// release or a hit's pull), and the ledger counts what D pins.
func TestSharedLedgerReleasesOnce(t *testing.T) {
	g := newReplicas(t, 2, budgetBlocks)
	var convs []*conversation
	for i := range 8 {
		conv := g.conv(i)
		g.turn(t, i%2, conv, 0)
		g.settle(t)
		convs = append(convs, conv)
	}
	for turn := 1; turn < 3; turn++ {
		for i, conv := range convs {
			g.turn(t, (i+turn)%2, conv, turn)
			g.settle(t)
		}
	}
	require.True(t, g.settled())
	released := g.sum(func(s kvroute.Stats) int64 { return requested(s) + s.ReleasedSuperseded })
	require.Positive(t, g.sum(requested), "the budget bound")
	var per [2]int64
	for k, r := range g.routers {
		per[k] = requested(r.Stats())
	}
	assert.Zero(t, g.sum(func(s kvroute.Stats) int64 { return s.ReleaseGone }), "no release found its hold used through the other replica (releases by replica: %v)", per)
	assert.Zero(t, g.sum(func(s kvroute.Stats) int64 { return s.ReleaseFailures }))
	st := g.d.Stats()
	assert.Zero(t, st.StaleNotifies, "no hold released twice, nor after its use")
	assert.EqualValues(t, released, int64(st.NotifiedHolds-countHits(g.rec)), "every release freed a hold on D")
	assert.EqualValues(t, g.sum(requested), g.front.releases.Load(), "one release request per victim")
	assert.Equal(t, [2]int64{int64(st.BlocksPinned * 16), 0}, g.views(), "every replica counts what D pins")
	assert.Zero(t, st.WrongOutputs)
}

// A replica's Close leaves every hold counted: the closed replica's holds
// are still pinned on D and still in the Store, and the other replica
// counts them (its view is what D pins) and releases them when their
// retention ends, as its own.
func TestSharedLedgerOutlivesReplica(t *testing.T) {
	g := newReplicas(t, 2, 1024)
	for i := range 4 {
		g.turn(t, i%2, g.conv(i), 0)
	}
	g.settle(t)
	pinned := int64(g.d.Stats().BlocksPinned * 16)
	require.NoError(t, g.routers[0].Close())
	live := g.routers[1]
	assert.Equal(t, pinned, ledgerHeld(live), "the closed replica's holds stay counted")
	assert.Equal(t, 4, live.DecodeKV()[0].Handles)

	g.c.Clock.Advance(kvroute.Defaults().TTLs.Retention + time.Second)
	for i := 0; i < 5000 && (g.d.Stats().BlocksPinned > 0 || live.Stats().ReleasedExpired < 4); i++ {
		time.Sleep(time.Millisecond) // the live replica's sweep, every second of wall time
	}
	s := live.Stats()
	assert.EqualValues(t, 4, s.ReleasedExpired, "the live replica released every hold when its retention ended, the closed one's too")
	assert.Zero(t, s.ReleaseGone+s.ReleaseFailures)
	st := g.d.Stats()
	assert.Zero(t, st.BlocksPinned, "D pins nothing")
	assert.Zero(t, st.TTLBlocks, "nothing lapsed at D's TTL")
	assert.Zero(t, st.StaleNotifies)
	assert.Zero(t, ledgerHeld(live))
}

// Replicas given one Ledger must agree on what the Ledger takes from
// them: a later replica of the same settings is accepted, one whose
// Budget or TTLs differ is an error naming both values.
func TestSharedLedgerSettingsAgree(t *testing.T) {
	l, err := budget.New()
	require.NoError(t, err)
	mk := func(opts ...kvroute.Option) (*kvroute.Router, error) {
		return kvroute.New(append([]kvroute.Option{kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2")}, opts...)...)
	}
	dm := kvroute.DecodeMemory{Budget: 0.5, Ledger: l, MetricsInterval: -1}
	for range 2 {
		r, err := mk(kvroute.WithDecodeMemory(dm))
		require.NoError(t, err, "the same settings")
		require.NoError(t, r.Close())
	}
	other := dm
	other.Budget = 0.3
	r, err := mk(kvroute.WithDecodeMemory(other))
	require.Error(t, err)
	assert.Nil(t, r)
	assert.ErrorIs(t, err, kvroute.ErrInvalidConfig)
	for _, want := range []string{"WithDecodeMemory", "Ledger", "WithFraction(0.3)", "WithFraction(0.5)"} {
		assert.Contains(t, err.Error(), want)
	}
	ttls := kvroute.Defaults().TTLs
	ttls.Retention -= time.Minute
	r, err = mk(kvroute.WithDecodeMemory(dm), kvroute.WithTTLs(ttls))
	require.Error(t, err)
	assert.Nil(t, r)
	for _, want := range []string{"WithGrace(1m30s)", "WithGrace(30s)"} {
		assert.Contains(t, err.Error(), want)
	}
	l.SetCapacity("d", budget.Capacity{Tokens: 1000})
	_, b := l.Held("d", time.Now())
	assert.EqualValues(t, 500, b, "the first replica's Budget")
}

// legGate fronts a decode engine and holds the answer to the one request
// whose body contains match until open is closed: the router counts that
// decode leg in flight meanwhile. arrived is closed when D has answered it.
type legGate struct {
	proxy   *httputil.ReverseProxy
	match   []byte
	arrived chan struct{}
	open    chan struct{}
}

func (f *legGate) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.Body = io.NopCloser(bytes.NewReader(body))
	if !bytes.Contains(body, f.match) {
		f.proxy.ServeHTTP(w, r)
		return
	}
	rec := httptest.NewRecorder()
	f.proxy.ServeHTTP(rec, r)
	close(f.arrived)
	<-f.open
	for k, v := range rec.Header() {
		w.Header()[k] = v
	}
	w.WriteHeader(rec.Code)
	_, _ = w.Write(rec.Body.Bytes())
}

// Replicas sharing one Ledger count one another's decode legs in flight:
// a leg through replica 1 arriving while replica 0's long leg runs on the
// engine makes room for both (the holds and both legs would pass the
// capacity less the headroom; replica 1's leg and the holds alone would
// not), and every leg leaves the shared count when it ends.
func TestSharedLedgerCountsLegsInFlight(t *testing.T) {
	gate := &legGate{match: []byte("Agent 3. "), arrived: make(chan struct{}), open: make(chan struct{})}
	g := startReplicas(t, 2, budgetBlocks, kvroute.DecodeMemory{Budget: 1}, gate)
	for i := range 3 {
		g.turn(t, i%2, g.conv(i), 0)
	}
	g.settle(t)
	kv := g.routers[0].DecodeKV()[0]
	limit := kv.Capacity * 95 / 100 // the default Headroom, 0.05
	// Replica 0's leg: the holds and it fit under limit, by 24 tokens.
	long := g.conv(3)
	long.say(userText(0))
	ref, err := kvroutetest.Reference(long.path, long.body())
	require.NoError(t, err)
	long.maxTok = int(limit - kv.HeldTokens - int64(ref.PromptTokens) - 24)
	require.Positive(t, long.maxTok)
	done := make(chan string, 1)
	go func() { done <- post(t, g.srvs[0], long.path, long.body(), nil).text }()
	select {
	case <-gate.arrived:
	case <-time.After(20 * time.Second): // a hang detector
		close(gate.open)
		t.Fatal("the long leg never reached D")
	}
	live := kvroute.LiveTokens(g.routers[0])[0]
	require.Positive(t, live)
	assert.LessOrEqual(t, kv.HeldTokens+live, limit, "replica 0's leg made no room")
	assert.Equal(t, live, g.ledger.Running(kv.Endpoint, 0), "the ledger counts replica 0's leg")
	assert.Zero(t, requested(g.routers[0].Stats()))

	// Replica 1's leg: with the holds alone it fits; with replica 0's leg
	// it does not, and room is made for both.
	short := g.conv(4)
	short.say(userText(0))
	roomTurn(t, g.c, g.srvs[1], short) // fails, after a bound, if the leg waited on D behind the holds
	close(gate.open)
	want, err := kvroutetest.Reference(long.path, long.body())
	require.NoError(t, err)
	assert.Equal(t, want.Text, <-done)
	g.settle(t)
	s := g.routers[1].Stats()
	assert.Positive(t, s.ReleasedRoom, "replica 1 made room counting replica 0's leg")
	assert.Zero(t, s.ReleaseGone+s.ReleaseFailures)
	assert.Zero(t, g.ledger.Running(kv.Endpoint, 0), "every leg left the shared count")
	assert.Equal(t, []int64{0}, kvroute.LiveTokens(g.routers[0]))
	assert.Zero(t, g.d.Stats().WrongOutputs)
	assert.Zero(t, g.d.Stats().StaleNotifies)
}
