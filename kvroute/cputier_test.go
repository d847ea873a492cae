package kvroute_test

import (
	"cmp"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/threshold"
	"github.com/bidikv/bidikv/transport"
)

// tierBlocks is the decode engine's KV capacity in the CPU tier tests:
// 1,024 blocks of 16 tokens, a budget (half) of about two conversations of
// longSystem.
const tierBlocks = 1024

// longSystem is a system prompt of about 3,600 tokens: long enough that
// pulling it from a CPU tier beats computing it (threshold.Rates.PeerSaves).
var longSystem = strings.Repeat(systemPrompt+" ", 50)

// tierBlockSizes are the block sizes vLLM engines run (--block-size): the
// tier tests run at each, on every engine.
var tierBlockSizes = []int{16, 32, 64}

// tierSpec describes a tierRig: the engines' block size (0: 16); the
// decode engine's CPU tier in tokens (one-block chunks); the tier size
// the router is told, in tokens, and its peer address ("": the engine's
// own); decode-local turns; CPUTierFirst; the budget (0: 0.5); and front,
// when set, what stands between the router and an engine (it returns the
// URL the router is given for the engine at url).
type tierSpec struct {
	bs, dTokens, routerTokens int
	pTokens                   int // the prefill engine's GPU and tier (0: about one conversation, 4,800 tokens)
	peer                      string
	local, first              bool
	budget                    float64
	front                     func(t *testing.T, url string) string
}

// tierRig is a 1P1D cluster on a virtual clock whose decode engine has
// tierBlocks×16 tokens of KV blocks (a budget of half of them) and a CPU
// tier of s.dTokens in one-block chunks, written through with generated
// blocks and served to peers; the prefill engine's GPU and CPU tier hold
// about one conversation (so a turn finds little of its history on P);
// the router is told the decode engine's tier is s.routerTokens tokens,
// at s.peer. It returns the router's URL for the decode engine too.
func tierRig(t *testing.T, s tierSpec) (*kvroutetest.Cluster, *kvroutetest.VirtualClock, *kvroute.Router, string, *kvroutetest.Records) {
	t.Helper()
	bs := cmp.Or(s.bs, kvroutetest.DefaultBlockSize)
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := &kvroutetest.Cluster{Registry: kvroutetest.NewRegistry(), Clock: clk}
	common := []kvroutetest.Option{kvroutetest.WithRegistry(c.Registry), kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk),
		kvroutetest.WithPromptTokensDetails(true), kvroutetest.WithBlockSize(bs)}
	pTokens := cmp.Or(s.pTokens, 300*16)
	c.Prefill = append(c.Prefill, kvroutetest.NewEngine(t, append(common, kvroutetest.WithNumBlocks(pTokens/bs),
		kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: pTokens / bs, OffloadGenerated: true, P2P: true}))...))
	c.Decode = append(c.Decode, kvroutetest.NewEngine(t, append(common, kvroutetest.WithNumBlocks(tierBlocks*16/bs),
		kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: s.dTokens / bs, OffloadGenerated: true, P2P: true}))...))
	d := c.Decode[0]
	peer := s.peer
	if peer == "" {
		host, port, ok := d.RankP2PChannel(0)
		require.True(t, ok)
		peer = net.JoinHostPort(host, strconv.Itoa(port))
	}
	pURL, dURL := c.Prefill[0].URL(), d.URL()
	if s.front != nil {
		pURL, dURL = s.front(t, pURL), s.front(t, dURL)
	}
	rec := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(pURL), kvroute.WithDecode(dURL), kvroute.WithObserver(rec),
		kvroute.WithClock(clk.Now), kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: cmp.Or(s.budget, 0.5), CPUTierTokens: s.routerTokens,
			CPUTierPeers: map[string]string{dURL: peer}, Local: s.local, CPUTierFirst: s.first}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return c, clk, r, serve(t, r), rec
}

// checkTierBlocks checks a turn's tier tokens at block size bs: what an
// engine loaded from a CPU tier (loaded) is whole blocks, and the
// router's estimate of what the tier held (TurnRecord.PeerTokens) is
// whole blocks and no more than the prompt less one token (vLLM computes
// a prompt's last token; the tier's chunks are whole blocks: a partial
// last block stays on the GPU).
func checkTierBlocks(t *testing.T, bs int, tr kvroute.TurnRecord, loaded, prompt int) {
	t.Helper()
	assert.Zero(t, loaded%bs, "loaded %d tokens from a tier: not whole blocks of %d", loaded, bs)
	assert.Zero(t, tr.PeerTokens%bs, "the estimate %d is not whole blocks of %d", tr.PeerTokens, bs)
	if tr.PeerTokens > 0 {
		assert.LessOrEqual(t, tr.PeerTokens, prompt-1, "the estimate exceeds the prompt less one token")
	}
}

// tierTurn sends conv's next turn, checks its answer against a single
// engine's, and returns the router's record and the prefill engine's
// record of the turn's prefill leg.
func tierTurn(t *testing.T, c *kvroutetest.Cluster, srv string, rec *kvroutetest.Records, conv *conversation, id string) (kvroute.TurnRecord, kvroutetest.RequestRecord) {
	t.Helper()
	h := http.Header{}
	h.Set("X-Request-Id", id)
	res := post(t, srv, conv.path, conv.body(), h)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	want, err := kvroutetest.Reference(conv.path, conv.body())
	require.NoError(t, err)
	require.Equal(t, want.Text, res.text, "the answer differs from a single engine's")
	conv.hear(res.text)
	tr, ok := rec.Take(id)
	require.True(t, ok)
	var pr kvroutetest.RequestRecord
	for _, r := range c.Prefill[0].FinishedRequests(tr.EngineRequestID) {
		if r.Role == "prefill" {
			pr = r
		}
	}
	return tr, pr
}

// A hold the budget releases is demoted, not dropped: the conversation's
// next turn has its prefill engine pull the history (prompt and answer)
// from the decode engine's CPU tier by block hash, and computes only what
// the tier lacks; the answer is a single engine's. Turns whose hold was
// kept attach it as before (no tier pull).
func TestCPUTierDemotedHoldsArePulled(t *testing.T) {
	for _, bs := range tierBlockSizes {
		t.Run(strconv.Itoa(bs), func(t *testing.T) { demotedHoldsArePulled(t, bs) })
	}
}

func demotedHoldsArePulled(t *testing.T, bs int) {
	c, _, r, srv, rec := tierRig(t, tierSpec{bs: bs, dTokens: 4096 * 16, routerTokens: 4096 * 16})
	var convs []*conversation
	first := map[*conversation]int{}
	for i := range 6 {
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 200,
			messages: []message{{Role: "system", Content: fmt.Sprintf("Conversation %d. %s", i, longSystem)}}}
		conv.say(fmt.Sprintf("Conversation %d. %s", i, userText(i)))
		_, pr := tierTurn(t, c, srv, rec, conv, fmt.Sprintf("c%d-t1", i))
		first[conv] = pr.PromptTokens
		convs = append(convs, conv)
		if i == 0 {
			knowCapacity(t, r)
		}
	}
	settle(t, r, func(s kvroute.Stats) bool {
		kv := r.DecodeKV()[0]
		return kv.HeldTokens <= kv.Budget && requested(s) > 0 && requested(s)+s.ReleaseFailures+s.ReleaseGone >= int64(len(convs)-kv.Handles)
	})
	pulls := 0
	for i, conv := range convs {
		conv.say(userText(i + 1))
		tr, pr := tierTurn(t, c, srv, rec, conv, fmt.Sprintf("c%d-t2", i))
		checkTierBlocks(t, bs, tr, pr.PeerTokens, pr.PromptTokens)
		if tr.Reuse == kvroute.ReuseHit {
			assert.Empty(t, tr.PeerSource, "a GPU hold attached: no tier pull")
			assert.Zero(t, pr.PeerTokens)
			continue
		}
		pulls++
		assert.Equal(t, c.Decode[0].URL(), tr.PeerSource, "turn %d", i)
		assert.Equal(t, threshold.PathPeer, tr.Choice)
		assert.Positive(t, tr.PeerTokens)
		// P's GPU and tier held one conversation at a time: the history
		// comes from D's tier, all of its whole blocks.
		assert.GreaterOrEqual(t, pr.PeerTokens, first[conv]/bs*bs-16*bs, "turn %d: the history came from the decode engine's tier", i)
		assert.GreaterOrEqual(t, pr.CachedTokens+pr.TierTokens, first[conv]/bs*bs, "turn %d: nothing of the last prompt's whole blocks recomputed", i)
		t.Logf("turn %d: prompt %d cached %d tier %d peer %d computed %d (history about %d)", i, pr.PromptTokens, pr.CachedTokens, pr.TierTokens, pr.PeerTokens, pr.ComputedTokens, first[conv])
		assert.Equal(t, pr.PromptTokens, pr.CachedTokens+pr.TierTokens+pr.ComputedTokens)
	}
	require.Positive(t, pulls, "some holds were released")
	assert.EqualValues(t, pulls, r.Stats().PeerPulls)
	assert.Zero(t, c.Decode[0].Stats().WrongOutputs)
}

// A turn whose tier pull misses is served correctly at the cost of a
// recompute: the router's estimate says the history is there but the
// decode engine's tier lost it (a tier far smaller than the router was
// told), or the peer address reaches no tier at all. The prefill engine
// loads nothing from the peer, computes the prompt, and the answer is a
// single engine's.
func TestCPUTierPeerMissRecomputes(t *testing.T) {
	type miss struct {
		name, peer string
		bs, tokens int
	}
	var cases []miss
	for _, bs := range tierBlockSizes {
		cases = append(cases, miss{fmt.Sprint("tier evicted/", bs), "", bs, 8 * 16}, miss{fmt.Sprint("unreachable peer/", bs), "10.255.255.1:5710", bs, 4096 * 16})
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c, clk, r, srv, rec := tierRig(t, tierSpec{bs: tc.bs, dTokens: tc.tokens, routerTokens: 4096 * 16, peer: tc.peer})
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16,
				messages: []message{{Role: "system", Content: longSystem}}}
			conv.say(userText(0))
			tierTurn(t, c, srv, rec, conv, "t1")
			anotherTurn(t, c, srv, rec) // P now holds another conversation, not this one
			// Past the retention TTL and D's own: the GPU hold is gone,
			// the tier record stays (the ledger's horizon).
			clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + time.Minute)
			conv.say(userText(1))
			tr, pr := tierTurn(t, c, srv, rec, conv, "t2")
			checkTierBlocks(t, tc.bs, tr, pr.PeerTokens, pr.PromptTokens)
			assert.Equal(t, c.Decode[0].URL(), tr.PeerSource)
			assert.Zero(t, pr.PeerTokens, "nothing came from the peer")
			assert.Equal(t, pr.PromptTokens, pr.CachedTokens+pr.TierTokens+pr.ComputedTokens)
			assert.Positive(t, pr.ComputedTokens)
			assert.EqualValues(t, 1, r.Stats().PeerPulls, "the other conversation's first turn had no tier record")
			assert.True(t, tr.PeerShort, "P's cached tokens fall short of the estimate: counted")
			assert.EqualValues(t, 1, r.Stats().PeerShort)
		})
	}
}

// Past the TTL the GPU hold is gone but the decode engine's tier still
// holds the history: the next turn pulls it from there.
func TestCPUTierAfterTTL(t *testing.T) {
	for _, bs := range tierBlockSizes {
		t.Run(strconv.Itoa(bs), func(t *testing.T) { afterTTL(t, bs) })
	}
}

func afterTTL(t *testing.T, bs int) {
	c, clk, r, srv, rec := tierRig(t, tierSpec{bs: bs, dTokens: 4096 * 16, routerTokens: 4096 * 16})
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: longSystem}}}
	conv.say(userText(0))
	_, p1 := tierTurn(t, c, srv, rec, conv, "t1")
	anotherTurn(t, c, srv, rec) // P now holds another conversation, not this one
	clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + time.Minute)
	conv.say(userText(1))
	tr, pr := tierTurn(t, c, srv, rec, conv, "t2")
	checkTierBlocks(t, bs, tr, pr.PeerTokens, pr.PromptTokens)
	assert.Equal(t, kvroute.MissExpired, tr.MissReason)
	assert.Equal(t, c.Decode[0].URL(), tr.PeerSource)
	assert.Positive(t, pr.PeerTokens, "what P no longer held came from D's tier")
	assert.GreaterOrEqual(t, pr.CachedTokens+pr.TierTokens, p1.PromptTokens/bs*bs)
	assert.EqualValues(t, 1, r.Stats().PeerPulls)
}

// With decode-local turns on, a conversation whose GPU hold is gone but
// whose history the decode engine's tier holds, coming back with a short
// suffix, is answered on that decode engine as a plain request: it
// reloads the history from its own tier (no prefill leg, no network copy)
// and computes the suffix; the answer is a single engine's.
func TestCPUTierDecodeLocal(t *testing.T) {
	for _, bs := range tierBlockSizes {
		t.Run(strconv.Itoa(bs), func(t *testing.T) { decodeLocal(t, bs) })
	}
}

func decodeLocal(t *testing.T, bs int) {
	c, clk, r, srv, rec := tierRig(t, tierSpec{bs: bs, dTokens: 4096 * 16, routerTokens: 4096 * 16, local: true, pTokens: 800 * 16})
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: longSystem}}}
	conv.say(userText(0))
	_, p1 := tierTurn(t, c, srv, rec, conv, "t1")
	for i := range 5 { // D's GPU prefix cache turns over: the history is only in its tier
		other := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: fmt.Sprintf("Other %d. %s", i, longSystem)}}}
		other.say(userText(i))
		tierTurn(t, c, srv, rec, other, fmt.Sprintf("other-%d", i))
	}
	clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + time.Minute)
	conv.say(userText(1))
	h := http.Header{}
	h.Set("X-Request-Id", "t2")
	res := post(t, srv, conv.path, conv.body(), h)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	want, err := kvroutetest.Reference(conv.path, conv.body())
	require.NoError(t, err)
	require.Equal(t, want.Text, res.text)
	tr, ok := rec.Take("t2")
	require.True(t, ok)
	assert.Equal(t, threshold.PathLocal, tr.Choice)
	assert.Equal(t, kvroute.ReuseLocal, tr.Reuse)
	assert.Empty(t, tr.PrefillEndpoint, "no prefill leg")
	var dr kvroutetest.RequestRecord
	for _, q := range c.Decode[0].FinishedRequests(tr.EngineRequestID) {
		dr = q
	}
	assert.Equal(t, "plain", dr.Role)
	checkTierBlocks(t, bs, tr, dr.TierTokens, dr.PromptTokens)
	assert.GreaterOrEqual(t, dr.TierTokens, p1.PromptTokens/bs*bs-16*bs, "the history came from D's own tier")
	assert.GreaterOrEqual(t, dr.CachedTokens+dr.TierTokens, p1.PromptTokens/bs*bs)
	assert.Less(t, dr.ComputedTokens, 200, "only the suffix computed")
	t.Logf("D: prompt %d cached %d tier %d computed %d", dr.PromptTokens, dr.CachedTokens, dr.TierTokens, dr.ComputedTokens)
	assert.EqualValues(t, 1, r.Stats().ChoseLocal)
	assert.Zero(t, r.Stats().PeerPulls)
	assert.False(t, tr.LocalShort, "the reload was whole")
	assert.Zero(t, r.Stats().LocalShort)
	conv.hear(res.text)

	// The decode-local turn left no hold, but its record: the next turn,
	// whose long suffix (a tool's output) goes through a prefill leg,
	// pulls the history as the local turn left it in D's tier (prompt and
	// answer), not only the first turn's.
	conv.say(strings.Repeat(userText(2)+" ", 200))
	tr3, p3 := tierTurn(t, c, srv, rec, conv, "t3")
	require.Equal(t, c.Decode[0].URL(), tr3.PeerSource, "a pull from D's tier")
	assert.GreaterOrEqual(t, tr3.PeerTokens, dr.PromptTokens/bs*bs, "the estimate is the local turn's record")
	assert.GreaterOrEqual(t, p3.CachedTokens+p3.TierTokens, dr.PromptTokens/bs*bs, "and the tier held it")
	assert.False(t, tr3.PeerShort)
}

// A data-parallel decode engine serves each rank's tier at the base port
// plus the rank (vLLM binds them so): a CPUTierPeers entry for the
// engine's base URL addresses every rank, and each released hold's next
// turn pulls from the rank that decoded it.
func TestCPUTierDataParallelRanks(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	reg := kvroutetest.NewRegistry()
	common := []kvroutetest.Option{kvroutetest.WithRegistry(reg), kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk)}
	p := kvroutetest.NewEngine(t, append(common, kvroutetest.WithNumBlocks(300),
		kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: 300, OffloadGenerated: true, P2P: true}))...)
	d := kvroutetest.NewEngine(t, append(common, kvroutetest.WithNumBlocks(tierBlocks), kvroutetest.WithDPSize(2),
		kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: 4096, OffloadGenerated: true, P2P: true}))...)
	host, port, ok := d.RankP2PChannel(0)
	require.True(t, ok)
	base, err := transport.ParseEndpoint(d.URL())
	require.NoError(t, err)
	r0, r1 := base, base
	r0.Rank, r1.Rank = 0, 1
	rec := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(p.URL()), kvroute.WithEndpoints(kvroute.PhaseDecode, r0, r1), kvroute.WithObserver(rec),
		kvroute.WithClock(clk.Now), kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: 0.5, CPUTierTokens: 4096 * 16,
			CPUTierPeers: map[string]string{base.URL.String(): net.JoinHostPort(host, strconv.Itoa(port))}}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	srv := serve(t, r)
	c := &kvroutetest.Cluster{Prefill: []*kvroutetest.Engine{p}, Decode: []*kvroutetest.Engine{d}, Registry: reg, Clock: clk}
	var convs []*conversation
	for i := range 6 {
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16,
			messages: []message{{Role: "system", Content: fmt.Sprintf("Conversation %d. %s", i, longSystem)}}}
		conv.say(userText(i))
		tierTurn(t, c, srv, rec, conv, fmt.Sprintf("c%d-t1", i))
		convs = append(convs, conv)
	}
	clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + time.Minute) // every GPU hold gone
	ranks := map[string]bool{}
	for i, conv := range convs {
		conv.say(userText(i + 1))
		tr, pr := tierTurn(t, c, srv, rec, conv, fmt.Sprintf("c%d-t2", i))
		require.NotEmpty(t, tr.PeerSource, "turn %d", i)
		ranks[tr.PeerSource] = true
		assert.Positive(t, pr.PeerTokens, "turn %d: pulled from %s", i, tr.PeerSource)
		assert.Equal(t, tr.PeerSource, tr.DecodeEndpoint, "turn %d: decoded where the history is", i)
	}
	assert.Len(t, ranks, 2, "conversations on both ranks pulled from their own")
}

// With CPUTierFirst, a turn whose GPU hold the decode engine's tier holds
// whole pulls from the tier without verifying it (no render call on its
// way) and releases the hold through its prefill leg; without it, the
// hold is verified and attached.
func TestCPUTierFirst(t *testing.T) {
	for _, bs := range tierBlockSizes {
		for _, first := range []bool{false, true} {
			t.Run(fmt.Sprint(bs, "/", first), func(t *testing.T) {
				c, _, r, srv, rec := tierRig(t, tierSpec{bs: bs, dTokens: 4096 * 16, routerTokens: 4096 * 16, first: first, budget: 0.9})
				d := c.Decode[0]
				conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: longSystem}}}
				conv.say(userText(0))
				tierTurn(t, c, srv, rec, conv, "t1")
				knowCapacity(t, r)
				conv.say(userText(1))
				tr, pr := tierTurn(t, c, srv, rec, conv, "t2")
				checkTierBlocks(t, bs, tr, pr.PeerTokens, pr.PromptTokens)
				if !first {
					assert.Equal(t, kvroute.ReuseHit, tr.Reuse)
					assert.Positive(t, tr.VerifiedTokens, "verified by its render")
					assert.Empty(t, tr.PeerSource)
					return
				}
				assert.Equal(t, kvroute.MissCostModel, tr.MissReason)
				assert.Zero(t, tr.VerifiedTokens, "not verified: no render on the turn's way")
				assert.Equal(t, d.URL(), tr.PeerSource)
				assert.True(t, tr.Released, "the hold released through the prefill leg")
				assert.Equal(t, pr.PromptTokens, pr.CachedTokens+pr.TierTokens+pr.ComputedTokens)
				assert.Less(t, pr.ComputedTokens, 200, "the history came from P's cache and D's tier")
				assert.EqualValues(t, 1, d.Stats().NotifiedHolds)
			})
		}
	}
}

// anotherTurn runs the first turn of a conversation of longSystem's size,
// which turns over tierRig's prefill engine's caches (they hold about one).
func anotherTurn(t *testing.T, c *kvroutetest.Cluster, srv string, rec *kvroutetest.Records) {
	t.Helper()
	other := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: "Another. " + longSystem}}}
	other.say(userText(9))
	tierTurn(t, c, srv, rec, other, "other")
}

// The ledger ages a turn's record by the tokens later turns touch in the
// decode engine's CPU tier, not only by those they write: conversations
// whose histories the tier held already, coming back after A, move ahead
// of A's chunks in the tier's LRU order while writing little, and the
// next write pushes A out. A's next turn then finds its estimate at 0 and
// does not ask for a pull the tier cannot serve (counting only writes, it
// asked, and the pull came back short).
func TestCPUTierTouchesAgeHistory(t *testing.T) {
	const chunks = 480 // about two conversations of longSystem
	c, clk, r, srv, rec := tierRig(t, tierSpec{dTokens: chunks * 16, routerTokens: chunks * 16})
	conv := func(name string) *conversation {
		cv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16,
			messages: []message{{Role: "system", Content: name + ". " + longSystem}}}
		cv.say(name + ": " + userText(0))
		return cv
	}
	a, b, cc := conv("A"), conv("B"), conv("C")
	tierTurn(t, c, srv, rec, b, "b1")
	tierTurn(t, c, srv, rec, cc, "c1")
	tierTurn(t, c, srv, rec, a, "a1")
	for _, x := range []struct {
		cv *conversation
		id string
	}{{cc, "c2"}, {b, "b2"}} {
		x.cv.say(userText(1))
		tierTurn(t, c, srv, rec, x.cv, x.id)
	}
	clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + time.Minute) // A's GPU hold is gone
	a.say(userText(1))
	tr, pr := tierTurn(t, c, srv, rec, a, "a2")
	assert.NotEqual(t, kvroute.ReuseHit, tr.Reuse)
	assert.Empty(t, tr.PeerSource, "the estimate says the tier lost A's history: no pull asked")
	assert.False(t, tr.PeerShort)
	assert.Zero(t, pr.PeerTokens, "nothing loaded from the peer (counting only writes, a pull was asked and loaded a tenth of the history)")
	assert.Zero(t, r.Stats().PeerShort)
	assert.Positive(t, r.Stats().PeerSkipped)
	assert.Zero(t, c.Decode[0].Stats().WrongOutputs)
}
