package kvroute_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/threshold"
)

// front stands between the router and an engine: it passes every request
// through, and can hold the next completion request (hold) either before
// it reaches the engine ("request") or after the engine answered, before
// the answer goes back ("answer"), until the router gives the request up.
// arrived is closed when a request is held.
type front struct {
	proxy   *httputil.ReverseProxy
	mu      sync.Mutex
	hold    string
	arrived chan struct{}
}

// newFront starts a front for the engine at target and returns it and
// its URL.
func newFront(t *testing.T, target string) (*front, string) {
	u, err := url.Parse(target)
	require.NoError(t, err)
	f := &front{proxy: httputil.NewSingleHostReverseProxy(u)}
	f.proxy.FlushInterval = -1
	return f, newServer(t, f)
}

// holdNext has the next completion request held at point.
func (f *front) holdNext(point string) <-chan struct{} {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.hold, f.arrived = point, make(chan struct{})
	return f.arrived
}

func (f *front) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	f.mu.Lock()
	point, arrived := "", f.arrived
	if r.Method == http.MethodPost && strings.HasPrefix(r.URL.Path, "/v1/") {
		point, f.hold = f.hold, ""
	}
	f.mu.Unlock()
	switch point {
	case "request":
		// The server notices the client going away once the body is read.
		_, _ = io.Copy(io.Discard, r.Body)
		close(arrived)
		<-r.Context().Done()
	case "answer":
		rec := httptest.NewRecorder()
		f.proxy.ServeHTTP(rec, r)
		close(arrived)
		<-r.Context().Done()
	default:
		f.proxy.ServeHTTP(w, r)
	}
}

// Where a client goes away during a tier turn.
const (
	leaveUnsent   = "before the prefill leg reaches the engine"
	leavePrefill  = "before the prefill leg answers"
	leaveDecode   = "before the decode leg's first byte"
	leaveStream   = "mid-stream"
	leaveLastByte = "after the last byte"
)

// tierKind is a way a tier turn is served: its rig, and what brings the
// conversation to the turn the client leaves (after its first turn).
type tierKind struct {
	name  string
	spec  tierSpec
	ready func(t *testing.T, w *tierWorld)
}

// tierWorld is a tierRig with a front before each engine.
type tierWorld struct {
	c     *kvroutetest.Cluster
	clk   *kvroutetest.VirtualClock
	r     *kvroute.Router
	srv   string
	rec   *kvroutetest.Records
	p, d  *front
	dURL  string
	bs    int
	conv  *conversation
	other int
}

var tierKinds = []tierKind{
	{"peer pull", tierSpec{dTokens: 4096 * 16, routerTokens: 4096 * 16}, func(t *testing.T, w *tierWorld) {
		anotherTurn(t, w.c, w.srv, w.rec) // P now holds another conversation, not this one
		w.clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + 60e9)
	}},
	{"tier first", tierSpec{dTokens: 4096 * 16, routerTokens: 4096 * 16, first: true, budget: 0.9}, func(t *testing.T, w *tierWorld) {
		knowCapacity(t, w.r)
	}},
	{"decode local", tierSpec{dTokens: 4096 * 16, routerTokens: 4096 * 16, local: true}, func(t *testing.T, w *tierWorld) {
		for i := range 5 { // D's GPU prefix cache turns over: the history is only in its tier
			other := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: fmt.Sprintf("Other %d. %s", i, longSystem)}}}
			other.say(userText(i))
			tierTurn(t, w.c, w.srv, w.rec, other, fmt.Sprintf("other-%d", i))
		}
		w.clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + 60e9)
	}},
}

// A client that goes away at any point of a tier turn (a pull from the
// decode engine's tier, a CPUTierFirst turn whose GPU hold the prefill
// leg releases, a decode-local turn reloading from the tier) leaves no
// hold behind that the ledger does not account for, no placement that
// makes the next pull miss uncounted, and its next try is answered as a
// single engine answers it.
func TestCPUTierClientLeaves(t *testing.T) {
	for _, k := range tierKinds {
		for _, at := range []string{leaveUnsent, leavePrefill, leaveDecode, leaveStream, leaveLastByte} {
			if (at == leaveUnsent || at == leavePrefill) && k.spec.local {
				continue // no prefill leg
			}
			t.Run(k.name+"/"+at, func(t *testing.T) { clientLeaves(t, k, at) })
		}
	}
}

func clientLeaves(t *testing.T, k tierKind, at string) {
	w := &tierWorld{bs: kvroutetest.DefaultBlockSize}
	spec := k.spec
	spec.front = func(t *testing.T, u string) string {
		f, fu := newFront(t, u)
		if w.p == nil {
			w.p = f
		} else {
			w.d, w.dURL = f, fu
		}
		return fu
	}
	w.c, w.clk, w.r, w.srv, w.rec = tierRig(t, spec)
	w.conv = &conversation{path: kvroute.PathChatCompletions, maxTok: 16, stream: true, messages: []message{{Role: "system", Content: longSystem}}}
	w.conv.say(userText(0))
	tierTurn(t, w.c, w.srv, w.rec, w.conv, "t1")
	k.ready(t, w)
	w.conv.say(userText(1))
	leave(t, w, at)
	if at == leaveStream {
		// The simulated D decodes at once on the virtual clock, so it
		// finished the request before the router stopped reading: its
		// hold, whose handle the router may not have read, lapses at
		// D's TTL, as vLLM's does (a D still decoding aborts and frees).
		w.clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + time.Minute)
	}
	checkHolds(t, w) // the releases the turn left behind have ended
	if p := w.c.Prefill[0]; p.Stats().BlocksPinned > 0 {
		// P prefilled a leg no decode engine will read (the router gave
		// up on its answer, or on the decode leg), or a release request
		// (one block): vLLM holds those blocks until kv_lease_duration
		// ends.
		if at != leavePrefill && at != leaveDecode {
			assert.Equal(t, 1, p.Stats().BlocksPinned, "only a release request's block")
		}
		w.clk.Advance(30*time.Second + time.Second)
		assert.Zero(t, p.Stats().BlocksPinned, "the lease freed them")
	}
	if !k.spec.local {
		anotherTurn(t, w.c, w.srv, w.rec) // what P computed for the turn left is gone
	}
	// The client tries the turn again.
	tr, pr := tierTurn(t, w.c, w.srv, w.rec, w.conv, "t2-again")
	t.Logf("left %s: again: choice %s reuse %s peer %d short %v; P prompt %d cached %d tier %d peer %d; D pinned %d, P pinned %d",
		at, tr.Choice, tr.Reuse, tr.PeerTokens, tr.PeerShort, pr.PromptTokens, pr.CachedTokens, pr.TierTokens, pr.PeerTokens,
		w.c.Decode[0].Stats().BlocksPinned, w.c.Prefill[0].Stats().BlocksPinned)
	checkTierBlocks(t, w.bs, tr, pr.PeerTokens, pr.PromptTokens)
	if tr.PeerTokens > 0 && pr.CachedTokens+pr.TierTokens < tr.PeerTokens-w.bs {
		// The ledger's placement named KV the tier does not hold: the
		// pull missed, safely, and is counted.
		assert.True(t, tr.PeerShort)
		assert.Positive(t, w.r.Stats().PeerShort)
	}
	checkHolds(t, w)
}

// leave sends the conversation's next turn and goes away at.
func leave(t *testing.T, w *tierWorld, at string) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	h := http.Header{}
	h.Set("X-Request-Id", "t2")
	req := &kvroute.Request{Path: w.conv.path, Body: w.conv.body(), Header: h}
	var held <-chan struct{}
	switch at {
	case leaveUnsent:
		held = w.p.holdNext("request")
	case leavePrefill:
		held = w.p.holdNext("answer")
	case leaveDecode:
		held = w.d.holdNext("request")
	}
	type done struct {
		resp *kvroute.Response
		err  error
	}
	ch := make(chan done, 1)
	go func() {
		resp, err := w.r.Do(ctx, req)
		ch <- done{resp, err}
	}()
	if held != nil {
		<-held
		cancel()
	}
	d := <-ch
	if d.err != nil {
		require.ErrorIs(t, d.err, context.Canceled)
		return
	}
	resp := d.resp
	switch at {
	case leaveStream:
		_, err := resp.Next()
		require.NoError(t, err)
		cancel()
	case leaveLastByte:
		for {
			if _, err := resp.Next(); err != nil {
				require.ErrorIs(t, err, io.EOF)
				break
			}
		}
		cancel()
	}
	for {
		if _, err := resp.Next(); err != nil {
			if !errors.Is(err, io.EOF) {
				require.ErrorIs(t, err, context.Canceled)
			}
			break
		}
	}
	require.NoError(t, resp.Close())
	tr, ok := w.rec.Take("t2")
	require.True(t, ok)
	// The decode engine ends the leg on its own goroutine: whether it
	// finished the request or aborted it, wait until it has, so that a
	// hold it keeps starts its TTL before the test moves the clock.
	for range 5000 {
		for _, q := range w.c.Decode[0].FinishedRequests(tr.EngineRequestID) {
			if q.Role == "decode" || q.Role == "plain" {
				return
			}
		}
		time.Sleep(time.Millisecond)
	}
	t.Fatal("the decode engine never ended the leg")
}

// checkHolds checks, once the router's releases have ended, that the
// decode engine pins exactly the blocks of the holds the ledger counts.
func checkHolds(t *testing.T, w *tierWorld) {
	t.Helper()
	d := w.c.Decode[0]
	for range 5000 {
		if int64(d.Stats().BlocksPinned*w.bs) == w.r.DecodeKV()[0].HeldTokens {
			return
		}
		time.Sleep(time.Millisecond)
	}
	kv := w.r.DecodeKV()[0]
	t.Fatalf("D pins %d blocks, the ledger counts %d tokens in %d holds (D: %+v)", d.Stats().BlocksPinned, kv.HeldTokens, kv.Handles, d.Stats())
}

// A completion that continues the last one exactly (its prompt is the
// last prompt and answer, as a client that asks for more after a length
// finish sends it), at every block size: when those tokens are whole
// blocks the tier holds the whole new prompt, yet the router's estimate
// stays whole blocks no more than the prompt less one token (vLLM
// computes a prompt's last token).
func TestCPUTierContinuedCompletion(t *testing.T) {
	for _, bs := range tierBlockSizes {
		t.Run(fmt.Sprint(bs), func(t *testing.T) {
			// A first prompt whose continuation is whole blocks.
			var conv *conversation
			for pad := 0; conv == nil; pad++ {
				require.Less(t, pad, 8*bs, "no continuation of whole blocks")
				c := &conversation{path: kvroute.PathCompletions, maxTok: 16, prompt: longSystem + strings.Repeat(" x", pad)}
				c.say(userText(0))
				first, err := kvroutetest.Reference(c.path, c.body())
				require.NoError(t, err)
				next := *c
				next.hear(first.Text)
				again, err := kvroutetest.Reference(next.path, next.body())
				require.NoError(t, err)
				if again.PromptTokens%bs == 0 {
					conv = c
				}
			}
			c, clk, _, srv, rec := tierRig(t, tierSpec{bs: bs, dTokens: 4096 * 16, routerTokens: 4096 * 16})
			tierTurn(t, c, srv, rec, conv, "t1")
			anotherTurn(t, c, srv, rec)
			clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + time.Minute)
			tr, pr := tierTurn(t, c, srv, rec, conv, "t2") // the prompt and answer, nothing more
			t.Logf("prompt %d, estimate %d, loaded %d", pr.PromptTokens, tr.PeerTokens, pr.PeerTokens)
			require.Zero(t, pr.PromptTokens%bs)
			require.NotEmpty(t, tr.PeerSource)
			checkTierBlocks(t, bs, tr, pr.PeerTokens, pr.PromptTokens)
			assert.False(t, tr.PeerShort, "what the tier could give was loaded")
		})
	}
}

// A decode-local turn is chosen on the ledger's estimate that the decode
// engine's CPU tier holds the conversation. When the tier lost it (a tier
// far smaller than the router is told), the decode engine recomputes the
// history itself: the answer is still a single engine's, and the
// shortfall its cached tokens show is counted (Stats.LocalShort,
// TurnRecord.LocalShort), from a body or a stream's usage chunk; a stream
// without usage shows nothing, and a reload that succeeds is not counted.
func TestCPUTierLocalShort(t *testing.T) {
	type tc struct {
		name             string
		bs, dTokens      int
		stream, usage    bool
		short, reportsIt bool
	}
	var cases []tc
	for _, bs := range tierBlockSizes {
		cases = append(cases, tc{fmt.Sprint("lost/body/", bs), bs, 8 * 16, false, false, true, true})
	}
	cases = append(cases, tc{"lost/stream usage", 16, 8 * 16, true, true, true, true},
		tc{"lost/stream no usage", 16, 8 * 16, true, false, true, false},
		tc{"kept/body", 16, 4096 * 16, false, false, false, true},
		tc{"kept/stream usage", 16, 4096 * 16, true, true, false, true})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			cl, clk, r, srv, rec := tierRig(t, tierSpec{bs: c.bs, dTokens: c.dTokens, routerTokens: 4096 * 16, local: true, pTokens: 800 * 16})
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: longSystem}}}
			conv.say(userText(0))
			_, p1 := tierTurn(t, cl, srv, rec, conv, "t1")
			for i := range 5 { // D's GPU prefix cache turns over: the history is only in its tier, if there
				other := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: fmt.Sprintf("Other %d. %s", i, longSystem)}}}
				other.say(userText(i))
				tierTurn(t, cl, srv, rec, other, fmt.Sprintf("other-%d", i))
			}
			clk.Advance(kvroutetest.DefaultDecoderBlocksTTL + time.Minute)
			conv.say(userText(1))
			conv.stream = c.stream
			if c.usage {
				conv.extra = map[string]any{"stream_options": map[string]any{"include_usage": true}}
			}
			tr, _ := tierTurn(t, cl, srv, rec, conv, "t2") // the answer is a single engine's
			require.Equal(t, threshold.PathLocal, tr.Choice)
			assert.Equal(t, kvroute.ReuseLocal, tr.Reuse)
			assert.Empty(t, tr.PrefillEndpoint, "no prefill leg")
			assert.Zero(t, tr.PeerTokens, "a decode-local turn's estimate is not a pull's")
			var dr kvroutetest.RequestRecord
			for _, q := range cl.Decode[0].FinishedRequests(tr.EngineRequestID) {
				dr = q
			}
			t.Logf("D: prompt %d cached %d tier %d computed %d", dr.PromptTokens, dr.CachedTokens, dr.TierTokens, dr.ComputedTokens)
			if c.short {
				assert.Less(t, dr.CachedTokens+dr.TierTokens, p1.PromptTokens/2, "D's tier lost the history")
			} else {
				assert.GreaterOrEqual(t, dr.CachedTokens+dr.TierTokens, p1.PromptTokens/c.bs*c.bs, "D reloaded the history")
			}
			counted := c.short && c.reportsIt
			assert.Equal(t, counted, tr.LocalShort)
			assert.EqualValues(t, map[bool]int{true: 1}[counted], r.Stats().LocalShort)
			assert.False(t, tr.PeerShort)
		})
	}
}
