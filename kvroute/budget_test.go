package kvroute_test

import (
	"fmt"
	"io"
	"math"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/retention/budget"
)

// budgetBlocks is the decode engine's KV capacity in the budget tests: 64
// blocks of 16 tokens, a budget (half) of 512 tokens, about three of the
// conversations' first turns.
const budgetBlocks = 64

// releaseFront fronts a prefill engine and answers the router's release
// requests (User-Agent bidikv-release) as mode says: "" passes them on,
// "fail" answers 500, "hang" never answers until the request ends.
type releaseFront struct {
	mode     string
	proxy    *httputil.ReverseProxy
	releases atomic.Int32
}

func (f *releaseFront) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("User-Agent") == "bidikv-release" {
		f.releases.Add(1)
		switch f.mode {
		case "fail":
			http.Error(w, `{"error":{"message":"boom"}}`, http.StatusInternalServerError)
			return
		case "hang":
			// The body read, the server notices the router's cancellation
			// (Close) as the connection closes.
			_, _ = io.Copy(io.Discard, r.Body)
			<-r.Context().Done()
			return
		}
	}
	f.proxy.ServeHTTP(w, r)
}

// budgetRig is a 1P1D cluster on a virtual clock whose decode engine has
// budgetBlocks blocks (a budget of half of it), with a router whose prefill engine is behind a
// releaseFront.
func budgetRig(t *testing.T, mode string, opts ...kvroute.Option) (*kvroutetest.Cluster, *kvroute.Router, string, *releaseFront) {
	return memoryRig(t, mode, 1, nil, opts...)
}

// memoryRig is budgetRig with d decode engines and more engine options.
func memoryRig(t *testing.T, mode string, d int, engine []kvroutetest.Option, opts ...kvroute.Option) (*kvroutetest.Cluster, *kvroute.Router, string, *releaseFront) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, d, append([]kvroutetest.Option{kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk),
		kvroutetest.WithNumBlocks(budgetBlocks)}, engine...)...)
	u, err := url.Parse(c.Prefill[0].URL())
	require.NoError(t, err)
	front := &releaseFront{mode: mode, proxy: httputil.NewSingleHostReverseProxy(u)}
	// A budget of half the capacity unless opts give their own
	// WithDecodeMemory (the last one rules).
	base := []kvroute.Option{kvroute.WithPrefill(newServer(t, front)), kvroute.WithClock(clk.Now), kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: 0.5})}
	for _, e := range c.Decode {
		base = append(base, kvroute.WithDecode(e.URL()))
	}
	r, err := kvroute.New(append(base, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return c, r, serve(t, r), front
}

// settle waits, boundedly, until the router has chosen and sent the
// release requests of the holds over the budget: its ledger fits the
// budget and every victim's request has ended (counted by outcome).
func settle(t *testing.T, r *kvroute.Router, want func(kvroute.Stats) bool) {
	t.Helper()
	for range 5000 {
		if want(r.Stats()) {
			return
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatalf("the releases never settled: %+v", r.Stats())
}

// requested counts the holds released by release requests: over the
// budget, or to make room for a decode leg.
func requested(s kvroute.Stats) int64 { return s.ReleasedBudget + s.ReleasedRoom }

// oneTurns runs n single-turn conversations and checks every answer
// against a single engine's. They share their system prompt, which D
// stores, and the ledger counts, once.
func oneTurns(t *testing.T, r *kvroute.Router, srv string, n int, managed bool) []*conversation {
	return turnsOf(t, r, srv, n, managed, false)
}

// distinctTurns is oneTurns with conversations that share no block: each
// system prompt begins with the conversation's number.
func distinctTurns(t *testing.T, r *kvroute.Router, srv string, n int) []*conversation {
	return turnsOf(t, r, srv, n, true, true)
}

func turnsOf(t *testing.T, r *kvroute.Router, srv string, n int, managed, distinct bool) []*conversation {
	var convs []*conversation
	for i := range n {
		system := systemPrompt
		if distinct {
			system = fmt.Sprintf("Conversation %d. %s", i, systemPrompt)
		}
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: system}}}
		conv.say(fmt.Sprintf("Conversation %d. %s", i, userText(i)))
		conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
		convs = append(convs, conv)
		if i == 0 && managed {
			knowCapacity(t, r)
		}
	}
	return convs
}

// Issue 23.2: above its budget, an engine's holds worth least are released
// by release requests, in the background: at steady state the router's
// holds fit the budget, D freed each victim at its release (not at the
// TTL), and every answer, of the released conversations' next turns too,
// is a single engine's.
func TestBudgetReleasesOverBudget(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts []kvroute.Option
	}{{"default", nil}, {"no prefill timeout", []kvroute.Option{kvroute.WithTimeouts(kvroute.Timeouts{Prefill: -1})}}} {
		t.Run(tc.name, func(t *testing.T) { testBudgetReleases(t, tc.opts...) })
	}
}

func testBudgetReleases(t *testing.T, opts ...kvroute.Option) {
	c, r, srv, front := budgetRig(t, "", opts...)
	d := c.Decode[0]
	// Twelve: their shared system prompt is counted once, as D stores it
	// (eight fit the budget).
	convs := oneTurns(t, r, srv, 12, true)
	settle(t, r, func(s kvroute.Stats) bool {
		kv := r.DecodeKV()[0]
		// Every hold the ledger let go (each a victim: no turn took
		// one) has its release's outcome counted.
		victims := int64(len(convs) - kv.Handles)
		return kv.HeldTokens <= kv.Budget && requested(s)+s.ReleaseFailures+s.ReleaseGone >= int64(front.releases.Load()) && front.releases.Load() > 0 &&
			requested(s)+s.ReleaseFailures+s.ReleaseGone >= victims
	})
	kv := r.DecodeKV()[0]
	require.EqualValues(t, budgetBlocks*16, kv.Capacity)
	assert.EqualValues(t, budgetBlocks*16/2, kv.Budget)
	assert.LessOrEqual(t, kv.HeldTokens, kv.Budget, "the router's holds fit the budget")
	s := r.Stats()
	assert.Positive(t, requested(s))
	assert.Zero(t, s.ReleaseFailures)
	st := d.Stats()
	assert.EqualValues(t, requested(s), st.NotifiedHolds, "D freed every victim at its release")
	assert.Zero(t, st.TTLBlocks)
	assert.LessOrEqual(t, int64(st.UsedBlocks*16), kv.Budget, "D holds no more than the budget")
	assert.Equal(t, int(requested(s)), int(front.releases.Load()), "one release request per victim")
	// The conversations come back: released ones miss, kept ones hit;
	// every answer is a single engine's.
	for i, conv := range convs {
		conv.say(userText(i + 1))
		releaseTurn(t, srv, conv.path, conv.body(), nil)
	}
	assert.Zero(t, d.Stats().WrongOutputs)
}

// With free memory nothing is released: holds under the budget are kept
// to the TTL, as before.
func TestBudgetUnderBudgetKeepsAll(t *testing.T) {
	c, r, srv, front := budgetRig(t, "")
	oneTurns(t, r, srv, 2, true)
	kv := r.DecodeKV()[0]
	assert.LessOrEqual(t, kv.HeldTokens, kv.Budget)
	assert.Zero(t, front.releases.Load())
	assert.Zero(t, requested(r.Stats()))
	assert.Zero(t, c.Decode[0].Stats().NotifiedHolds)
}

// Budget negative turns the management off: every hold is kept to the
// TTL, over the capacity's budget too (hold everything).
func TestBudgetOff(t *testing.T) {
	c, r, srv, front := budgetRig(t, "", kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: -1}))
	oneTurns(t, r, srv, 8, false)
	assert.Zero(t, front.releases.Load())
	assert.Zero(t, requested(r.Stats()))
	assert.Zero(t, c.Decode[0].Stats().NotifiedHolds)
	assert.Equal(t, 8, r.DecodeKV()[0].Handles)
}

// A release request never delays or fails a client turn: with a prefill
// engine that hangs or fails them, every turn completes with a single
// engine's answer; failed releases are counted and their holds lapse at
// the TTL.
func TestBudgetReleaseNeverDelaysTurns(t *testing.T) {
	for _, mode := range []string{"hang", "fail"} {
		t.Run(mode, func(t *testing.T) {
			c, r, srv, front := budgetRig(t, mode)
			oneTurns(t, r, srv, 10, true)
			settle(t, r, func(kvroute.Stats) bool { return front.releases.Load() > 0 })
			if mode == "hang" {
				// Bounded: at most DecodeMemory's Releases in flight.
				assert.LessOrEqual(t, int(front.releases.Load()), kvroute.Defaults().DecodeMemory.Releases)
				return
			}
			settle(t, r, func(s kvroute.Stats) bool { return s.ReleaseFailures >= int64(front.releases.Load()) })
			s := r.Stats()
			assert.Zero(t, requested(s))
			assert.Positive(t, s.ReleaseFailures)
			d := c.Decode[0]
			before := d.Stats()
			assert.Zero(t, before.NotifiedHolds)
			c.Clock.Advance(kvroute.Defaults().TTLs.DecoderBlocks + time.Second)
			after := d.Stats()
			assert.Zero(t, after.UsedBlocks, "every hold lapsed at the TTL")
			// (TTLBlocks counts each hold's blocks, shared prefix blocks
			// in each.)
			assert.GreaterOrEqual(t, after.TTLBlocks-before.TTLBlocks, before.UsedBlocks)
		})
	}
}

// Two routers sharing one store never release a hold twice: each releases
// only what it takes from the store, and a later hold another router
// stored under a victim's key goes back untouched. D sees no stale
// notification, every release frees a hold, and every answer is a single
// engine's.
func TestBudgetReplicasShareStore(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk),
		kvroutetest.WithNumBlocks(budgetBlocks))
	u, err := url.Parse(c.Prefill[0].URL())
	require.NoError(t, err)
	front := &releaseFront{proxy: httputil.NewSingleHostReverseProxy(u)}
	pURL := newServer(t, front)
	store, err := retention.NewMemory()
	require.NoError(t, err)
	var routers []*kvroute.Router
	var srvs []string
	rec := &kvroutetest.Records{}
	for range 2 {
		r, err := kvroute.New(kvroute.WithPrefill(pURL), kvroute.WithDecode(c.Decode[0].URL()), kvroute.WithClock(clk.Now),
			kvroute.WithStore(store), kvroute.WithObserver(rec), kvroute.WithIdentifier(kvroute.ContinuationKeys{ByConversationID: true}),
			kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent}))
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() })
		routers, srvs = append(routers, r), append(srvs, serve(t, r))
	}
	var convs []*conversation
	// Router 0 serves the first turns, router 1 the second ones of every
	// other conversation, under the same keys.
	for i := range 8 {
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
		conv.say(fmt.Sprintf("Conversation %d. %s", i, userText(i)))
		h := http.Header{"X-Session-Id": {fmt.Sprintf("s%d", i)}}
		conv.hear(releaseTurn(t, srvs[0], conv.path, conv.body(), h))
		if i == 0 {
			knowCapacity(t, routers[0])
		}
		convs = append(convs, conv)
		if i%2 == 1 {
			conv.say(userText(i + 1))
			conv.hear(releaseTurn(t, srvs[1], conv.path, conv.body(), h))
			if i == 1 {
				knowCapacity(t, routers[1])
			}
		}
	}
	settle(t, routers[0], func(kvroute.Stats) bool {
		var n int64
		for _, r := range routers {
			s := r.Stats()
			n += requested(s) + s.ReleaseFailures
		}
		return n >= int64(front.releases.Load()) && front.releases.Load() > 0
	})
	st := c.Decode[0].Stats()
	assert.Zero(t, st.StaleNotifies, "no hold released twice")
	var released int64
	for _, r := range routers {
		s := r.Stats()
		released += requested(s) + s.ReleasedSuperseded
		assert.Zero(t, s.ReleaseFailures)
	}
	assert.Positive(t, released)
	assert.EqualValues(t, released, st.NotifiedHolds-countHits(rec), "every release freed a hold")
	assert.Zero(t, st.WrongOutputs)
}

// countHits is how many turns attached a handle (D's hold then ends by
// P's read, also a notification).
func countHits(rec *kvroutetest.Records) int {
	n := 0
	for _, tr := range rec.All() {
		if tr.Reuse == kvroute.ReuseHit {
			n++
		}
	}
	return n
}

// DecodeMemory's management fields are validated by New, each error
// naming the option and the field.
func TestDecodeMemoryOptions(t *testing.T) {
	l, err := budget.New()
	require.NoError(t, err)
	own, err := budget.New(budget.WithFraction(0.5), budget.WithCapacity(1<<20))
	require.NoError(t, err)
	for _, tc := range []struct {
		m     kvroute.DecodeMemory
		field string
	}{
		{kvroute.DecodeMemory{Budget: 1.5}, "Budget"},
		{kvroute.DecodeMemory{Budget: math.NaN()}, "Budget"},
		{kvroute.DecodeMemory{HighWatermark: 2}, "HighWatermark"},
		{kvroute.DecodeMemory{Capacity: -1}, "Capacity"},
		{kvroute.DecodeMemory{Releases: -1}, "Releases"},
		{kvroute.DecodeMemory{Headroom: 1}, "Headroom"},
		{kvroute.DecodeMemory{Headroom: math.NaN()}, "Headroom"},
		{kvroute.DecodeMemory{Ledger: own, Budget: 0.3}, "Ledger"},
		{kvroute.DecodeMemory{Ledger: own, Capacity: 1 << 20}, "Ledger"},
	} {
		r, err := kvroute.New(kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithDecodeMemory(tc.m))
		require.Error(t, err, "%+v", tc.m)
		assert.Nil(t, r)
		assert.ErrorIs(t, err, kvroute.ErrInvalidConfig)
		assert.Contains(t, err.Error(), "WithDecodeMemory")
		assert.Contains(t, err.Error(), tc.field)
	}
	for _, m := range []kvroute.DecodeMemory{{}, {Budget: -1}, {Budget: 1, Capacity: 1 << 20, HighWatermark: -1, MetricsInterval: -1, Releases: 1, Headroom: -1}, {Ledger: l}, {Ledger: own, Budget: -1}} {
		r, err := kvroute.New(kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithDecodeMemory(m))
		require.NoError(t, err, "%+v", m)
		require.NoError(t, r.Close())
	}
}

// A Ledger given to the Router takes the Router's Budget and Capacity
// where its maker left budget.WithFraction and budget.WithCapacity at
// their defaults: budget.New() alone holds up to the Router's 0.9 of an
// engine's capacity, not the package's 0.5. A Ledger built with its own
// keeps them.
func TestLedgerInheritsBudget(t *testing.T) {
	for _, tc := range []struct {
		name   string
		opts   []budget.Option
		m      kvroute.DecodeMemory
		budget int64 // of an engine of 1000 tokens
	}{
		{"defaults", nil, kvroute.DecodeMemory{}, 900},
		{"the router's Budget", nil, kvroute.DecodeMemory{Budget: 0.3}, 300},
		{"the ledger's own", []budget.Option{budget.WithFraction(0.5)}, kvroute.DecodeMemory{}, 500},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l, err := budget.New(tc.opts...)
			require.NoError(t, err)
			tc.m.Ledger, tc.m.MetricsInterval = l, -1
			r, err := kvroute.New(kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithDecodeMemory(tc.m))
			require.NoError(t, err)
			defer r.Close()
			l.SetCapacity("d", budget.Capacity{Tokens: 1000})
			_, got := l.Held("d", time.Now())
			assert.Equal(t, tc.budget, got)
		})
	}
	// The Router's Capacity, for engines that report none.
	l, err := budget.New()
	require.NoError(t, err)
	r, err := kvroute.New(kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"),
		kvroute.WithDecodeMemory(kvroute.DecodeMemory{Ledger: l, Capacity: 2000, MetricsInterval: -1}))
	require.NoError(t, err)
	defer r.Close()
	assert.Equal(t, int64(2000), l.Capacity("d"))
}

// Issue 23.3: the router feeds the ledger's gap model from what it sees:
// every turn that continues a retained handle (attached or not) is an
// observation of the pause since that handle's turn ended, with the
// conversation's turn number and whether the reply ended in tool calls,
// per tenant and model. The model reports it (Ledger.Snapshot).
func TestGapModelLearnsFromTurns(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk))
	l, err := budget.New()
	require.NoError(t, err)
	r := newRouter(t, c, kvroute.WithDecodeMemory(kvroute.DecodeMemory{Ledger: l}))
	srv := serve(t, r)
	const gap = 40 * time.Second
	for i := range 4 {
		h := http.Header{"Authorization": {fmt.Sprintf("Bearer key-%d", i%2)}}
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
		for turn := range 3 {
			conv.say(fmt.Sprintf("Conversation %d. %s", i, userText(turn)))
			conv.hear(releaseTurn(t, srv, conv.path, conv.body(), h))
			clk.Advance(gap)
		}
	}
	s := l.Stats()
	assert.EqualValues(t, 8, s.Returned, "two returns in each of four conversations")
	snap := l.Snapshot(clk.Now(), 2*time.Minute)
	require.GreaterOrEqual(t, len(snap.Classes), 3, "overall, then one class per tenant")
	all := snap.Classes[0]
	assert.Empty(t, all.Class)
	assert.InDelta(t, 8, all.Returns, 0.5)
	assert.InDelta(t, gap.Seconds(), all.P50.Seconds(), gap.Seconds()/2, "the learned median pause")
	for _, cl := range snap.Classes[1:] {
		assert.Contains(t, cl.Class, kvroutetest.DefaultModel, "classes are tenant and model")
		assert.NotContains(t, cl.Class, "key-", "no credential in a class")
	}
	// The second turns were learned as such: the first turn group saw 4
	// returns, the second 4.
	var first, second float64
	for _, f := range all.Within {
		switch f.FirstTurn {
		case 1:
			first += f.Observations
		case 2:
			second += f.Observations
		}
	}
	assert.Positive(t, first)
	assert.Positive(t, second, "turn numbers are kept from turn to turn")
}

// BenchmarkTurnMemory is BenchmarkTurn with decode memory management off
// (Budget -1: hold everything) and on with a known capacity the holds
// never fill (the ledger, the pressure and the release phase on every
// turn, nothing released).
func BenchmarkTurnMemory(b *testing.B) {
	for _, m := range []struct {
		name string
		dm   kvroute.DecodeMemory
	}{{"off", kvroute.DecodeMemory{Budget: -1}}, {"on", kvroute.DecodeMemory{Capacity: 1 << 40}}} {
		for _, mode := range []kvroute.VerificationMode{kvroute.VerifyContent, kvroute.VerifyTokens} {
			b.Run(fmt.Sprintf("%s/%s/hist=10KB", m.name, mode), func(b *testing.B) {
				benchmarkTurn(b, mode, 10<<10, kvroute.WithDecodeMemory(m.dm))
			})
		}
	}
}

// The property test's random conversations (edits, compactions, stripped
// reasoning, swapped tenants...) on a decode engine small enough that the
// budget binds, four at a time: releases through the prefill leg and by
// release requests run beside the turns, and no answer differs from a
// single engine's, no engine reads a freed or expired hold, and nothing is
// attached after its release.
func TestRandomConversationsUnderBudget(t *testing.T) {
	if testing.Short() {
		t.Skip("long property test")
	}
	for _, cl := range propClasses[:2] {
		t.Run(cl.name, func(t *testing.T) {
			engine := append(append([]kvroutetest.Option{kvroutetest.WithStreamHandles(true), kvroutetest.WithNumBlocks(512)},
				cl.engine...), kvroutetest.WithRecomputeThreshold(0))
			c := kvroutetest.NewCluster(t, 1, 2, engine...)
			rec := &kvroutetest.Records{}
			r := newRouter(t, c, kvroute.WithThreshold(0), kvroute.WithObserver(rec),
				kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: 0.25}))
			url := serve(t, r)
			st := propRun(t, url, rec, cl, engine, kvroute.VerifyTokens, 1000, 48)
			s := r.Stats()
			t.Logf("%d conversations, %d turns, %d hits, %d wrong; released: %d superseded, %d budget, %d failed, %d gone",
				st.conversations, st.turns, st.hits, st.wrong, s.ReleasedSuperseded, requested(s), s.ReleaseFailures, s.ReleaseGone)
			assert.Zero(t, st.wrong, "answers that differ from the single engine's")
			assert.Zero(t, st.tenantHits)
			assert.Positive(t, st.hits)
			assert.Positive(t, s.ReleasedSuperseded+requested(s), "releases ran")
			for _, e := range append(c.Prefill, c.Decode...) {
				es := e.Stats()
				assert.Zero(t, es.WrongOutputs)
				assert.Zero(t, es.FreedReads, "a read of a released hold")
				assert.Zero(t, es.ExpiredReads)
				assert.Zero(t, es.PoisonedHits)
			}
		})
	}
}

// The gap model learns from every conversation that comes back, its hold
// released or not: a next turn that finds its hold released (a miss) is
// observed as a return after the hold ended, at its real gap, never as a
// conversation that did not come back (which would teach the model that
// released conversations never return, and release more).
func TestGapModelSeesReturnsAfterRelease(t *testing.T) {
	l, err := budget.New(budget.WithFraction(0.5))
	require.NoError(t, err)
	recs := &kvroutetest.Records{}
	_, r, srv, front := budgetRig(t, "", kvroute.WithDecodeMemory(kvroute.DecodeMemory{Ledger: l}), kvroute.WithObserver(recs))
	// resolved: every hold the ledger chose as a victim has its release's
	// outcome counted. A victim whose conversation's turn took its handle
	// first is counted (ReleaseGone) only when its release comes to take
	// it, which may be after that turn, and after every release request
	// sent so far has ended (the releases wait for one another, bounded by
	// DecodeMemory's Releases). s is read before the ledger, so that a
	// victim chosen in between is waited for too.
	resolved := func(s kvroute.Stats) bool {
		return requested(s)+s.ReleaseFailures+s.ReleaseGone+s.ReleaseSkipped >= l.Stats().Released
	}
	convs := oneTurns(t, r, srv, 12, true) // eight fit the budget
	settle(t, r, func(s kvroute.Stats) bool {
		return front.releases.Load() > 0 && requested(s)+s.ReleaseFailures+s.ReleaseGone >= int64(front.releases.Load()) && resolved(s)
	})
	released := requested(r.Stats())
	require.Positive(t, released)
	// The next turns' own holds may push others over the budget while
	// they run, so more of the conversations still to come back can find
	// their hold released: each turn's record says whether its lookup
	// found the handle (a return while held) or not (after the hold
	// ended), and the ledger must have observed exactly that.
	afterEnd := 0
	for i, conv := range convs {
		conv.say(userText(i + 1))
		id := fmt.Sprintf("gap-%d", i)
		releaseTurn(t, srv, conv.path, conv.body(), http.Header{"X-Request-Id": {id}})
		rec, ok := recs.Take(id)
		require.True(t, ok, "turn %d observed", i)
		if rec.Reuse == kvroute.ReuseMiss && rec.MissReason == kvroute.MissNotFound {
			afterEnd++
		}
	}
	// A victim chosen while its conversation's turn was on its way is
	// observed as a return after its hold ended, but the turn took the
	// handle first (a hit) and the release finds it gone: once every
	// victim's release has come to take its handle, those are ReleaseGone.
	settle(t, r, func(s kvroute.Stats) bool {
		return requested(s)+s.ReleaseFailures+s.ReleaseGone >= int64(front.releases.Load()) && resolved(s)
	})
	s := l.Stats()
	assert.GreaterOrEqual(t, afterEnd, int(released), "every conversation released before it came back finds no handle")
	assert.EqualValues(t, int64(afterEnd)+r.Stats().ReleaseGone, s.ReturnedAfterEnd, "each released conversation's return is observed")
	assert.EqualValues(t, len(convs), s.Returned+s.ReturnedAfterEnd, "every conversation came back")
	assert.Zero(t, s.Censored, "none is counted as never returning")
}
