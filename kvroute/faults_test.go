package kvroute_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httputil"
	"net/url"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
)

// faultCase injects one kind of fault into a conversation. inject runs
// before turn i and returns how many faults it injected and whether the
// turn may end in a clear error (no engine can serve it correctly).
type faultCase struct {
	name    string
	stream  bool
	engine  []kvroutetest.Option
	router  []kvroute.Option
	ttls    kvroute.TTLs // the router's, besides a prefill lease of an hour
	virtual bool         // engines and router on a virtual clock
	inject  func(g *rig, i int) (faults int, mayFail bool)
}

const faultTurns = 8

func faultCases() []faultCase {
	every := func(k int) func(i int) bool { return func(i int) bool { return i > 1 && i%k == 0 } }
	at := every(3)
	return []faultCase{
		{name: "decode engine down", inject: func(g *rig, i int) (int, bool) {
			if i != 4 {
				return 0, false
			}
			g.lastDecode().Close() // the affinity engine, with the retained KV
			return 1, false
		}},
		{name: "prefill engine down", inject: func(g *rig, i int) (int, bool) {
			if i != 4 {
				return 0, false
			}
			g.lastPrefill().Close()
			return 1, false
		}},
		{name: "decode refusing", inject: func(g *rig, i int) (int, bool) {
			switch {
			case at(i):
				g.lastDecode().Refuse(true)
				return 1, false
			case i > 1 && at(i-1):
				for _, e := range g.c.Decode {
					e.Refuse(false)
				}
			}
			return 0, false
		}},
		{name: "prefill refusing", inject: func(g *rig, i int) (int, bool) {
			if at(i) {
				for _, e := range g.c.Prefill[1:] {
					e.Refuse(false)
				}
				g.c.Prefill[0].Refuse(true)
				// A request on a pooled connection the engine closed fails
				// with "server closed idle connection", which
				// transport.Retryable does not retry: a clear 502.
				return 1, true
			}
			return 0, false
		}},
		{name: "503 on prefill and decode", inject: func(g *rig, i int) (int, bool) {
			if !at(i) {
				return 0, false
			}
			g.lastPrefill().FailNext(1, http.StatusServiceUnavailable)
			g.lastDecode().FailNext(1, http.StatusServiceUnavailable)
			return 2, false
		}},
		{name: "decode stall", router: []kvroute.Option{kvroute.WithTimeouts(kvroute.Timeouts{FirstByte: 300 * time.Millisecond})}, inject: func(g *rig, i int) (int, bool) {
			if !at(i) {
				return 0, false
			}
			g.lastDecode().Stall(time.Minute)
			return 1, false
		}},
		{name: "prefill stall", router: []kvroute.Option{kvroute.WithTimeouts(kvroute.Timeouts{Prefill: 300 * time.Millisecond})}, inject: func(g *rig, i int) (int, bool) {
			if !at(i) {
				// The stall stays armed until P0 is picked.
				return 0, i > 3
			}
			for _, e := range g.c.Prefill {
				e.Stall(time.Minute)
				break
			}
			// The prefill leg's total deadline is not retried
			// (transport.Retryable): a clear 504 when P0 is picked.
			return 1, true
		}},
		{name: "stream cut before the first event", stream: true, engine: []kvroutetest.Option{kvroutetest.WithStreamHandles(true)}, inject: func(g *rig, i int) (int, bool) {
			if !at(i) {
				return 0, false
			}
			g.lastDecode().CutStreamAfter(0)
			return 1, false
		}},
		{name: "stream cut after 3 events", stream: true, engine: []kvroutetest.Option{kvroutetest.WithStreamHandles(true)}, inject: func(g *rig, i int) (int, bool) {
			if !at(i) {
				return 0, false
			}
			g.lastDecode().CutStreamAfter(3)
			return 1, true // bytes reached the client: the stream ends with an error
		}},
		{name: "decode restart", inject: func(g *rig, i int) (int, bool) {
			if !at(i) {
				return 0, false
			}
			g.lastDecode().Restart()
			return 1, false
		}},
		{name: "prefill restart", inject: func(g *rig, i int) (int, bool) {
			if !at(i) {
				return 0, false
			}
			g.lastPrefill().Restart()
			return 1, false
		}},
		{name: "retained handle expired", virtual: true,
			// The router is told a longer decoder TTL than the engines
			// have, so it attaches handles the engines let expire.
			ttls: kvroute.TTLs{DecoderBlocks: 10 * time.Minute, Retention: 9 * time.Minute},
			inject: func(g *rig, i int) (int, bool) {
				if !at(i) {
					return 0, false
				}
				g.c.Clock.Advance(8 * time.Minute)
				return 1, false
			}},
		{name: "retention TTL passed", virtual: true, inject: func(g *rig, i int) (int, bool) {
			if !at(i) {
				return 0, false
			}
			g.c.Clock.Advance(kvroute.Defaults().TTLs.Retention + time.Second)
			return 1, false
		}},
	}
}

// TestFaults runs a conversation through 2P2D and 4P4D clusters with each
// kind of fault and checks that every turn gets the reference answer (or a
// clear error where none is possible), that no engine read freed or expired
// blocks and that no handle reached the client (the leak guard).
func TestFaults(t *testing.T) {
	var total tally
	for _, size := range []int{2, 4} {
		for _, fc := range faultCases() {
			t.Run(fmt.Sprintf("%dP%dD/%s", size, size, fc.name), func(t *testing.T) {
				opts := append([]kvroutetest.Option{kvroutetest.WithLeaseDuration(time.Hour)}, fc.engine...)
				if fc.virtual {
					opts = append(opts, kvroutetest.WithClock(kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))))
				}
				c := kvroutetest.NewCluster(t, size, size, opts...)
				ttls := fc.ttls
				ttls.PrefillLease = time.Hour
				ropts := append([]kvroute.Option{kvroute.WithTTLs(ttls)}, fc.router...)
				g := newRig(t, c, fc.stream, ropts...)
				for i := 1; i <= faultTurns; i++ {
					n, mayFail := fc.inject(g, i)
					g.n.faults += n
					g.turn(i, mayFail)
				}
				g.finish()
				total.add(&g.n)
			})
		}
	}
	t.Logf("TOTAL faults %d turns %d correct %d errors %d wrong %d freed reads %d expired reads %d leaks 0 (leak guard)",
		total.faults, total.turns, total.correct, total.errors, total.wrong, total.freedReads, total.expiredReads)
}

// TestPrefillLeaseExpired moves the clock past P's lease between the legs:
// the router must not send P's handle to D, but redo the turn as a miss.
func TestPrefillLeaseExpired(t *testing.T) {
	for _, size := range []int{2, 4} {
		t.Run(fmt.Sprintf("%dP%dD", size, size), func(t *testing.T) {
			clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
			c := kvroutetest.NewCluster(t, size, size, kvroutetest.WithClock(clk))
			var mu sync.Mutex
			stallNext := false
			def := &kvroute.LeastLoaded{}
			sel := kvroute.SelectorFunc(func(ctx context.Context, s *kvroute.Selection) (int, error) {
				mu.Lock()
				if s.Phase == kvroute.PhaseDecode && stallNext {
					stallNext = false
					clk.Advance(kvroutetest.DefaultLeaseDuration + time.Second)
				}
				mu.Unlock()
				return def.Select(ctx, s)
			})
			g := newRig(t, c, false, kvroute.WithSelector(sel))
			for i := 1; i <= faultTurns; i++ {
				if i%3 == 0 {
					mu.Lock()
					stallNext = true
					mu.Unlock()
					g.n.faults++
				}
				g.turn(i, false)
				if i%3 == 0 {
					assert.Equal(t, kvroute.ReuseMiss, g.obs.Last().Reuse, "turn %d was redone as a miss", i)
					assert.Equal(t, 2, g.obs.Last().PrefillAttempts, "turn %d", i)
				}
			}
			g.finish()
		})
	}
}

// TestRetryAfter checks that a prefill 503 with Retry-After is retried
// after the engine's delay, on another engine.
func TestRetryAfter(t *testing.T) {
	c := kvroutetest.NewCluster(t, 2, 1)
	// A front for the first prefill engine that answers 503 Retry-After: 2.
	target, err := url.Parse(c.Prefill[0].URL())
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(target)
	busy := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == kvroute.PathChatCompletions {
			w.Header().Set("Retry-After", "2")
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"error":{"message":"busy","type":"server_error","code":503}}`))
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	var mu sync.Mutex
	var waits []time.Duration
	policy := transport.RetryPolicy{NewTimer: func() backoff.Timer { return &instantTimer{mu: &mu, waits: &waits} }}
	obs := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(busy, c.Prefill[1].URL()), kvroute.WithDecode(c.Decode[0].URL()),
		kvroute.WithFailover(kvroute.Failover{PrefillRetry: policy}), kvroute.WithObserver(obs), kvroute.WithSelector(&kvroutetest.RoundRobin{}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	u := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8, messages: []message{{Role: "system", Content: systemPrompt}}}
	conv.say(userText(1))
	res := post(t, u, conv.path, conv.body(), nil)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	assert.Equal(t, reference(t, conv.path, conv.body()), res.text)
	assert.Equal(t, 2, obs.Last().PrefillAttempts)
	assert.Equal(t, c.Prefill[1].URL(), obs.Last().PrefillEndpoint)
	mu.Lock()
	defer mu.Unlock()
	assert.Equal(t, []time.Duration{2 * time.Second}, waits, "the wait honours Retry-After")
}

// TestDecodeRetryAfter: a decode engine's 503 reaches the client with the
// engine's own Retry-After, as a prefill engine's does: every answer other
// than 2xx goes through the one engine client (package upstream).
func TestDecodeRetryAfter(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	target, err := url.Parse(c.Decode[0].URL())
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(target)
	busy := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == kvroute.PathChatCompletions {
			w.Header().Set("Retry-After", "9")
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(http.StatusServiceUnavailable)
			_, _ = w.Write([]byte(`{"error":{"message":"busy","type":"server_error","code":503}}`))
			return
		}
		proxy.ServeHTTP(w, r)
	}))
	r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(busy))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8, messages: []message{{Role: "system", Content: systemPrompt}}}
	conv.say(userText(1))
	res := post(t, serve(t, r), conv.path, conv.body(), nil)
	assert.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.raw)
	assert.Equal(t, "9", res.header.Get("Retry-After"), "the decode engine's own")
}

// TestNoEngineLeft checks the clear error when every engine is down.
func TestNoEngineLeft(t *testing.T) {
	for _, phase := range []kvroute.Phase{kvroute.PhasePrefill, kvroute.PhaseDecode} {
		t.Run(string(phase), func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 2, 2)
			policy := transport.RetryPolicy{NewTimer: func() backoff.Timer { return &instantTimer{mu: &sync.Mutex{}, waits: new([]time.Duration)} }}
			g := newRig(t, c, false, kvroute.WithFailover(kvroute.Failover{PrefillRetry: policy}))
			g.turn(1, false)
			down := c.Decode
			if phase == kvroute.PhasePrefill {
				down = c.Prefill
			}
			for _, e := range down {
				e.Close()
			}
			res := g.turn(2, true)
			assert.Equal(t, http.StatusBadGateway, res.status, "%s", res.raw)
			assert.Contains(t, string(res.raw), string(phase)+"_failed")
			g.finish()
		})
	}
}
