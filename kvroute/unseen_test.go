package kvroute_test

import (
	"context"
	"fmt"
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
	"github.com/bidikv/bidikv/transport"
)

// The engine is the truth: two routers in front of one decode engine,
// each with its own store and ledger (two processes), as replicas of a
// router that shares no ledger or a second router of another team. B's
// holds are invisible to A's ledger, but not to the engine: A reads them
// in the engine's vllm:kv_cache_usage_perc as unseen KV (DecodeKV.Unseen)
// and counts it as used, so A's holds yield to it and the engine's own
// usage stays within A's budget. Before, A budgeted its holds against the
// whole engine as if nothing else were there: the engine pinned B's holds
// and A's up to A's whole budget on top. Every answer is a single
// engine's.
func TestUnseenKVCountsAsUsed(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk),
		kvroutetest.WithNumBlocks(budgetBlocks))
	d := c.Decode[0]
	u, err := url.Parse(c.Prefill[0].URL())
	require.NoError(t, err)
	front := &releaseFront{proxy: httputil.NewSingleHostReverseProxy(u)}
	pURL := newServer(t, front)
	var ledger *budget.Budget // the last router's: Stats().Released counts the victims it chose
	router := func(share float64) (*kvroute.Router, string) {
		store, err := retention.NewMemory()
		require.NoError(t, err)
		ledger, err = budget.New()
		require.NoError(t, err)
		r, err := kvroute.New(kvroute.WithPrefill(pURL), kvroute.WithDecode(d.URL()), kvroute.WithClock(clk.Now),
			kvroute.WithStore(store), kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: share, Ledger: ledger}))
		require.NoError(t, err)
		t.Cleanup(func() { _ = r.Close() })
		return r, serve(t, r)
	}
	turn := func(srv string, i int) {
		// Prompts that share no prefix: D's prefix cache shares no block
		// between the holds, and the ledgers count them as D does.
		own := fmt.Sprintf("Conversation %d. %s", i, systemPrompt)
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: own}}}
		conv.say(userText(i))
		conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
	}

	// B holds two conversations' KV on the engine, within its own budget.
	b, bSrv := router(1)
	knowCapacity(t, b)
	for i := range 2 {
		turn(bSrv, i)
	}
	blockSize := int64(16)
	bPinned := int64(d.Stats().BlocksPinned) * blockSize
	require.Positive(t, bPinned)
	require.Zero(t, b.Stats().ReleasedBudget+b.Stats().ReleasedRoom, "B keeps its holds")

	// A starts, reads the engine, and sees B's holds as unseen KV.
	a, aSrv := router(0.75)
	knowCapacity(t, a)
	kv := a.DecodeKV()[0]
	assert.InDelta(t, bPinned, kv.Unseen, float64(blockSize), "A sees what B holds as unseen: %+v", kv)
	for i := 2; i < 10; i++ {
		turn(aSrv, i)
	}
	// The releases run in the background: wait, boundedly, until A's
	// holds fit beside the unseen KV and the release of every hold A's
	// ledger chose has ended (a victim leaves the ledger when chosen; under
	// load its release request may not even be sent yet) and D has freed
	// each (P's notification reaches D after P answers).
	aLedger := ledger
	settle(t, a, func(s kvroute.Stats) bool {
		kv := a.DecodeKV()[0]
		return kv.HeldTokens+kv.Unseen <= kv.Budget && requested(s)+s.ReleaseFailures+s.ReleaseGone >= aLedger.Stats().Released &&
			int64(d.Stats().NotifiedHolds) >= requested(s)
	})
	kv = a.DecodeKV()[0]
	assert.Positive(t, requested(a.Stats()), "A released holds of its own")
	assert.LessOrEqual(t, kv.HeldTokens+kv.Unseen, kv.Budget, "A's holds and the unseen KV within A's budget: %+v", kv)
	pinned := int64(d.Stats().BlocksPinned) * blockSize
	assert.LessOrEqual(t, pinned, kv.Budget+blockSize, "the engine's holds, as it counts them, within A's budget: %d tokens pinned; A %+v; D %+v; A stats %+v", pinned, kv, d.Stats(), a.Stats())
	assert.Zero(t, b.Stats().ReleasedBudget+b.Stats().ReleasedRoom, "A released none of B's holds")
	assert.Zero(t, d.Stats().WrongOutputs)
}

// Engines that leave the pool leave the ledger: decode engines come and
// go under new addresses (pods), each holding KV while it served; once an
// engine is no longer among the Router's decode endpoints and its holds
// ended, the ledger drops it, so the ledger follows the engines in use,
// not every engine the Router ever saw. Before, every engine stayed.
func TestLedgerForgetsEnginesThatLeft(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 3, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk),
		kvroutetest.WithNumBlocks(budgetBlocks))
	ledger, err := budget.New()
	require.NoError(t, err)
	r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(c.Decode[0].URL()), kvroute.WithClock(clk.Now),
		kvroute.WithDecodeMemory(kvroute.DecodeMemory{Ledger: ledger}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	srv := serve(t, r)
	engines := func() []string {
		var out []string
		for _, u := range ledger.Usage(clk.Now()) {
			out = append(out, u.Engine)
		}
		return out
	}
	for i, d := range c.Decode {
		// The pool is this one engine now (a rollout replaced the last).
		ep, err := transport.ParseEndpoint(d.URL())
		require.NoError(t, err)
		require.NoError(t, r.SetEndpoints(kvroute.PhaseDecode, ep))
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16,
			messages: []message{{Role: "system", Content: fmt.Sprintf("Conversation %d. %s", i, systemPrompt)}}}
		conv.say(userText(i))
		conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
		assert.Contains(t, engines(), d.URL(), "the engine holds the turn's KV")
		if i > 0 {
			assert.Contains(t, engines(), c.Decode[i-1].URL(), "an engine that left is kept while it holds")
		}
	}
	assert.Len(t, engines(), 3, "the engines that left still hold")
	clk.Advance(10 * time.Minute) // every hold ended (past both TTLs)
	require.NoError(t, r.SetEndpoints(kvroute.PhaseDecode, func() transport.Endpoint {
		ep, err := transport.ParseEndpoint(c.Decode[2].URL())
		require.NoError(t, err)
		return ep
	}()))
	assert.Equal(t, []string{c.Decode[2].URL()}, engines(), "only the engine in the pool is left")
	assert.Zero(t, c.Decode[2].Stats().WrongOutputs)
}

// A reading of the decode engine's /metrics that lands after a turn's
// decode leg ended (it no longer counts live) and before the retain adds
// its hold to the ledger finds the leg's blocks on the engine in neither
// the ledger's holds nor its live legs. Before, it counted them as unseen
// KV, and that figure stayed until the next reading while the hold was
// counted too: the next leg's arrival counted the leg's tokens twice and
// released a hold for room it did not need (Stats.ReleasedRoom). A Store
// whose Put has the router read the engine first forces that order: leg
// ends, reading, hold added, next leg arrives. The ended leg is counted
// as the router's own until its hold is in the ledger: no unseen KV, no
// room made for a leg that fits beside the holds.
func TestUnseenKVOmitsLegEndedBeforeItsHold(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			mem, err := retention.NewMemory()
			require.NoError(t, err)
			store := &readingStore{Store: mem}
			_, r, srv, front := budgetRig(t, "", kvroute.WithStore(store))
			distinctTurns(t, r, srv, 1) // the engine's capacity read, one hold
			require.Zero(t, r.DecodeKV()[0].Unseen, "%+v", r.DecodeKV()[0])
			var readErr error
			unseenThen := int64(-1)
			store.read = func() {
				readErr = kvroute.ReadDecodeMetrics(r)
				unseenThen = r.DecodeKV()[0].Unseen
			}
			store.armed.Store(true)
			conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 16,
				messages: []message{{Role: "system", Content: "Conversation 1. " + systemPrompt}}}
			conv.say("Conversation 1. " + userText(1))
			conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
			require.False(t, store.armed.Load(), "the retain's Put had the engine read")
			require.NoError(t, readErr)
			kv := r.DecodeKV()[0]
			require.Equal(t, 2, kv.Handles)
			assert.Zero(t, unseenThen, "the ended leg's blocks are not unseen KV at the reading: %+v", kv)
			assert.Zero(t, kv.Unseen, "the hold is not counted as unseen KV too: %+v", kv)

			// The next leg may take what the holds leave under the limit:
			// it fits, no room is made.
			next := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 1,
				messages: []message{{Role: "system", Content: "Conversation 2. " + systemPrompt}}}
			next.say("Conversation 2. " + userText(2))
			probe, err := kvroutetest.Reference(next.path, next.body())
			require.NoError(t, err)
			limit := min(int64(float64(kv.Capacity)*(1-kvroute.Defaults().DecodeMemory.Headroom)), kv.Budget)
			next.maxTok = int(limit - kv.HeldTokens - int64(probe.PromptTokens))
			require.Positive(t, next.maxTok, "the leg fits beside the holds")
			next.hear(releaseTurn(t, srv, next.path, next.body(), nil))
			settle(t, r, func(s kvroute.Stats) bool {
				return requested(s)+s.ReleaseFailures+s.ReleaseGone >= int64(front.releases.Load())
			})
			s := r.Stats()
			assert.Zero(t, s.ReleasedRoom, "no room made for a leg that fits")
			assert.Zero(t, s.ReleasedBudget, "the holds fit the budget")
			assert.Zero(t, front.releases.Load())
			assert.Equal(t, 3, r.DecodeKV()[0].Handles)
		})
	}
}

// readingStore is a Store whose next Put, once armed, first runs read.
type readingStore struct {
	kvroute.Store
	armed atomic.Bool
	read  func()
}

func (s *readingStore) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if s.armed.CompareAndSwap(true, false) {
		s.read()
	}
	return s.Store.Put(ctx, key, value, ttl)
}
