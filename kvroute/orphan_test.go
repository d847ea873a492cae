package kvroute_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
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
	"github.com/bidikv/bidikv/retention"
)

// failingStore is a Store whose Put, and Take when told, fail.
type failingStore struct {
	kvroute.Store
	putErr, takeErr error
}

func (s *failingStore) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if s.putErr != nil {
		return s.putErr
	}
	return s.Store.Put(ctx, key, value, ttl)
}

func (s *failingStore) Take(ctx context.Context, key string) ([]byte, bool, error) {
	if s.takeErr != nil {
		return nil, false, s.takeErr
	}
	return s.Store.Take(ctx, key)
}

func memoryStore(t *testing.T) kvroute.Store {
	s, err := retention.NewMemory()
	require.NoError(t, err)
	return s
}

// orphanTotal counts the holds released because the router did not keep
// their handle.
func orphanTotal(s kvroute.Stats) int64 {
	return s.ReleasedNChoices + s.ReleasedRefused + s.ReleasedStoreError + s.ReleasedOverwritten
}

// Issue 28.2: a decode answer the router does not retain still pins D's
// blocks until the engine's TTL, unless the router releases it. Every
// handle the router receives and does not keep is released at once (a
// release request, in the background), counted by reason; the turn's
// answer is a single engine's, and D holds nothing afterwards although
// the clock never moves. A handle the router cannot tell is out of the
// store is not released (Unreleasable) and lapses at the TTL.
func TestOrphanHoldsReleased(t *testing.T) {
	boom := errors.New("boom")
	for _, tc := range []struct {
		name   string
		extra  map[string]any
		opts   func(t *testing.T) []kvroute.Option
		reason func(kvroute.Stats) int64 // nil: not releasable
	}{
		{name: "n > 1", extra: map[string]any{"n": 2}, reason: func(s kvroute.Stats) int64 { return s.ReleasedNChoices }},
		{name: "reuse off", opts: func(*testing.T) []kvroute.Option { return []kvroute.Option{kvroute.WithReuse(false)} },
			reason: func(s kvroute.Stats) int64 { return s.ReleasedRefused }},
		{name: "identifier refuses (content rules)", extra: map[string]any{"continue_final_message": true, "add_generation_prompt": false},
			opts: func(*testing.T) []kvroute.Option {
				return []kvroute.Option{kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent})}
			}, reason: func(s kvroute.Stats) int64 { return s.ReleasedRefused }},
		{name: "store refuses the size", opts: func(t *testing.T) []kvroute.Option {
			return []kvroute.Option{kvroute.WithStore(&failingStore{Store: memoryStore(t), putErr: fmt.Errorf("full: %w", retention.ErrTooLarge)})}
		}, reason: func(s kvroute.Stats) int64 { return s.ReleasedRefused }},
		{name: "store fails on put", opts: func(t *testing.T) []kvroute.Option {
			return []kvroute.Option{kvroute.WithStore(&failingStore{Store: memoryStore(t), putErr: boom})}
		}, reason: func(s kvroute.Stats) int64 { return s.ReleasedStoreError }},
		{name: "store down", opts: func(t *testing.T) []kvroute.Option {
			return []kvroute.Option{kvroute.WithStore(&failingStore{Store: memoryStore(t), putErr: boom, takeErr: boom})}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk))
			var opts []kvroute.Option
			if tc.opts != nil {
				opts = tc.opts(t)
			}
			r := newRouter(t, c, opts...)
			srv := serve(t, r)
			d := c.Decode[0]
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, extra: tc.extra,
				messages: []message{{Role: "system", Content: systemPrompt}}}
			conv.say(userText(1))
			body := conv.body()
			res := post(t, srv, conv.path, body, nil)
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			want, err := kvroutetest.Reference(conv.path, body)
			require.NoError(t, err)
			assert.Equal(t, want.Text, res.text, "the answer differs from a single engine's")
			require.Positive(t, d.Stats().Holds, "D held the turn's blocks")
			if tc.reason == nil {
				settle(t, r, func(s kvroute.Stats) bool { return s.Unreleasable > 0 })
				assert.Zero(t, orphanTotal(r.Stats()))
				assert.Zero(t, d.Stats().NotifiedHolds, "nothing released")
				clk.Advance(kvroute.Defaults().TTLs.DecoderBlocks + time.Second)
				assert.Zero(t, d.Stats().UsedBlocks, "the hold lapsed at the TTL")
				return
			}
			settle(t, r, func(s kvroute.Stats) bool { return tc.reason(s) > 0 })
			s, st := r.Stats(), d.Stats()
			assert.EqualValues(t, 1, tc.reason(s))
			assert.EqualValues(t, 1, orphanTotal(s), "one release, one reason")
			assert.Zero(t, s.ReleaseFailures+s.Unreleasable)
			assert.Equal(t, 1, st.NotifiedHolds, "D freed the hold at its release")
			assert.Zero(t, st.UsedBlocks, "D holds nothing")
			assert.Zero(t, st.TTLBlocks, "nothing lapsed: the clock never moved")
			assert.Zero(t, st.WrongOutputs)
			assert.Zero(t, r.DecodeKV()[0].Handles, "the ledger counts nothing")
		})
	}
}

// gateFront fronts a prefill engine and holds every turn's prefill leg
// (release requests pass) until n have arrived: the n turns looked their
// key up before any of them retained.
type gateFront struct {
	n       int
	proxy   http.Handler
	mu      sync.Mutex
	arrived int
	open    chan struct{}
}

func (g *gateFront) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Header.Get("User-Agent") != "bidikv-release" {
		g.mu.Lock()
		if g.arrived++; g.arrived == g.n {
			close(g.open)
		}
		g.mu.Unlock()
		select {
		case <-g.open:
		case <-time.After(10 * time.Second): // a hang detector
		}
	}
	g.proxy.ServeHTTP(w, r)
}

// Issue 28.2: turns of one conversation at once, under one conversation
// id, each look the key up before any retains; each retains its handle
// under the same key. The Store keeps the last, and every earlier one is
// released, not overwritten: D ends up holding what the ledger counts
// (measured before: 32 such holds pinned 394 of D's 399 blocks while the
// budget counted one).
func TestOverwrittenHoldsReleased(t *testing.T) {
	const n = 6
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk))
	u, err := url.Parse(c.Prefill[0].URL())
	require.NoError(t, err)
	gate := &gateFront{n: n, proxy: httputil.NewSingleHostReverseProxy(u), open: make(chan struct{})}
	r, err := kvroute.New(kvroute.WithPrefill(newServer(t, gate)), kvroute.WithDecode(c.Decode[0].URL()), kvroute.WithClock(clk.Now),
		kvroute.WithIdentifier(kvroute.ContinuationKeys{ByConversationID: true}),
		kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyContent}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	srv := serve(t, r)
	d := c.Decode[0]
	session := http.Header{"Authorization": {"Bearer key-a"}, "X-Session-Id": {"c1"}}
	var wg sync.WaitGroup
	for i := range n {
		wg.Go(func() {
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16,
				messages: []message{{Role: "system", Content: fmt.Sprintf("Agent %d. %s", i, systemPrompt)}}}
			conv.say(userText(i))
			releaseTurn(t, srv, conv.path, conv.body(), session)
		})
	}
	wg.Wait()
	settle(t, r, func(s kvroute.Stats) bool { return s.ReleasedOverwritten >= n-1 })
	s, st := r.Stats(), d.Stats()
	assert.EqualValues(t, n, s.Stored)
	assert.EqualValues(t, n-1, s.ReleasedOverwritten, "every handle but the last released")
	assert.Zero(t, s.ReleaseFailures+s.Unreleasable)
	assert.Equal(t, n-1, st.NotifiedHolds)
	assert.Zero(t, st.StaleNotifies)
	kv := r.DecodeKV()[0]
	assert.Equal(t, 1, kv.Handles)
	assert.EqualValues(t, kv.HeldTokens, st.UsedBlocks*16, "D holds what the ledger counts")
	assert.Zero(t, st.WrongOutputs)
}

// A decode handle vLLM would misread (here a port out of range), or one
// of push mode, is not retained and is sent nowhere, not even in a release
// request: it is counted (Unreleasable) and lapses at the engine's TTL.
func TestUnreleasableHandlesSentNowhere(t *testing.T) {
	for _, h := range []string{
		strings.Replace(testDHandle, `"remote_port":5601`, `"remote_port":70000`, 1),
		strings.Replace(testDHandle, `"tp_size":1`, `"tp_size":1,"transfer_mode":"push"`, 1),
	} {
		f := newFake(t)
		f.decode = func(w http.ResponseWriter, _ map[string]json.RawMessage) { writeJSON(w, decodeAnswer("hello", h)) }
		obs := &kvroutetest.Records{}
		r := fakeRouter(t, f, obs)
		srv := serve(t, r)
		res := post(t, srv, kvroute.PathChatCompletions, chatBody(false, "hi"), nil)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		assert.False(t, obs.Last().Stored)
		settle(t, r, func(s kvroute.Stats) bool { return s.Unreleasable > 0 })
		assert.Zero(t, orphanTotal(r.Stats()))
		f.mu.Lock()
		for _, q := range f.reqs {
			assert.NotEqual(t, "release", q.role, "no release request")
		}
		f.mu.Unlock()
	}
}
