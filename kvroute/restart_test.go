package kvroute_test

import (
	"fmt"
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
)

// restartCluster starts 1P1D engines with engine ids fixed in their
// configuration (unique per engine, as vLLM needs), or random ones.
func restartCluster(t *testing.T, fixed bool, opts ...kvroutetest.Option) *kvroutetest.Cluster {
	c := &kvroutetest.Cluster{Registry: kvroutetest.NewRegistry()}
	for i, role := range []string{"p", "d"} {
		o := append([]kvroutetest.Option{kvroutetest.WithRegistry(c.Registry), kvroutetest.WithStreamHandles(true)}, opts...)
		if fixed {
			o = append(o, kvroutetest.WithEngineID(fmt.Sprintf("%s-engine-%d", role, i)))
		}
		e := kvroutetest.NewEngine(t, o...)
		if role == "p" {
			c.Prefill = append(c.Prefill, e)
		} else {
			c.Decode = append(c.Decode, e)
		}
	}
	return c
}

// noMetrics is a front for an engine whose /metrics has no
// process_start_time_seconds (vLLM with several API server processes).
func noMetrics(t *testing.T, target string) string {
	u, err := url.Parse(target)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	return newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			_, _ = w.Write([]byte("# HELP vllm:num_requests_running Number of requests in model execution batches.\n# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name=\"sim-model\"} 0.0\n"))
			return
		}
		rp.ServeHTTP(w, r)
	}))
}

// Issue 21.8: a decode engine that restarted between two turns of a
// conversation must never get the handle it issued before the restart
// attached. With a fixed engine id the new process would serve other
// blocks under the old ids (a wrong answer, no error); with a random one
// the prefill engine's read would fail. The router notices the restart
// from the engine's process_start_time_seconds (re-read when older than
// WithRestartCheck, or after any failure to reach the engine), from a new
// engine id in its handles, or, on engines without that metric, from a
// failure to reach it.
func TestDecodeRestartNeverAttachesOldHandles(t *testing.T) {
	cases := []struct {
		name    string
		fixed   bool
		virtual bool // the restart takes 90 s of the virtual clock
		metrics bool // the engine's /metrics has process_start_time_seconds
		gap     bool // a turn fails to reach the engine while it restarts
		reason  kvroute.MissReason
	}{
		{name: "fixed id, start time", fixed: true, virtual: true, metrics: true, reason: kvroute.MissRestarted},
		{name: "fixed id, start time after a gap", fixed: true, metrics: true, gap: true, reason: kvroute.MissRestarted},
		{name: "fixed id, no metric, gap", fixed: true, gap: true, reason: kvroute.MissRestarted},
		{name: "random id, start time", virtual: true, metrics: true, reason: kvroute.MissRestarted},
		{name: "random id, new engine id", metrics: false, reason: kvroute.MissRestarted},
	}
	for _, tc := range cases {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s stream=%v", tc.name, stream), func(t *testing.T) {
				var opts []kvroutetest.Option
				var clk *kvroutetest.VirtualClock
				if tc.virtual {
					clk = kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
					opts = append(opts, kvroutetest.WithClock(clk))
				}
				c := restartCluster(t, tc.fixed, opts...)
				d := c.Decode[0]
				dURL := d.URL()
				if !tc.metrics {
					dURL = noMetrics(t, dURL)
				}
				obs := &kvroutetest.Records{}
				ropts := []kvroute.Option{kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(dURL), kvroute.WithObserver(obs)}
				if clk != nil {
					ropts = append(ropts, kvroute.WithClock(clk.Now))
				}
				r, err := kvroute.New(ropts...)
				require.NoError(t, err)
				t.Cleanup(func() { _ = r.Close() })
				url := serve(t, r)

				conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
				turn := func(c *conversation, i int) turnResult {
					t.Helper()
					c.say(userText(i))
					body := c.body()
					res := post(t, url, c.path, body, nil)
					require.Equal(t, http.StatusOK, res.status, "turn %d: %s", i, res.raw)
					assert.Equal(t, reference(t, c.path, body), res.text, "turn %d differs from a single engine's", i)
					c.hear(res.text)
					return res
				}
				turn(conv, 1)
				turn(conv, 2)
				require.Equal(t, kvroute.ReuseHit, obs.Last().Reuse, "turn 2 reuses turn 1 (%s)", obs.Last().MissReason)

				if tc.gap {
					// The engine goes down: another client's turn fails.
					d.Refuse(true)
					other := chatBody(false, "Another client: "+systemPrompt)
					res := send(t, url, kvroute.PathChatCompletions, other, nil)
					require.NotEqual(t, http.StatusOK, res.status)
				}
				if clk != nil {
					clk.Advance(90 * time.Second) // loading the model again
				}
				d.Restart()
				d.Refuse(false)
				// The new process serves another conversation, in the
				// block ids the old handle names.
				other := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: "Other: " + systemPrompt}}}
				turn(other, 1)

				turn(conv, 3)
				rec := obs.Last()
				assert.Equal(t, kvroute.ReuseMiss, rec.Reuse)
				assert.Equal(t, tc.reason, rec.MissReason)
				assert.Equal(t, 1, rec.PrefillAttempts, "the old handle never reached a prefill engine")
				turn(conv, 4)
				assert.Equal(t, kvroute.ReuseHit, obs.Last().Reuse, "handles of the new process are reused (%s)", obs.Last().MissReason)

				st := r.Stats()
				assert.Positive(t, st.RestartedHandles)
				for _, e := range append(c.Prefill, c.Decode...) {
					es := e.Stats()
					assert.Zero(t, es.FreedReads+es.LoadFailures+es.WrongOutputs+es.PoisonedHits, "%+v", es)
				}
			})
		}
	}
}

// A decode engine whose /metrics cannot be read keeps its handles out of
// use (MissEngineUnconfirmed, put back) but in the store, and is read again
// only once per WithRestartCheck: when it answers again, they are attached.
func TestRestartCheckUnreadable(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := restartCluster(t, true, kvroutetest.WithClock(clk))
	u, err := url.Parse(c.Decode[0].URL())
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	var broken atomic.Bool
	var reads atomic.Int32
	front := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			reads.Add(1)
			if broken.Load() {
				// The connection breaks: no answer at all.
				conn, _, err := http.NewResponseController(w).Hijack()
				if err == nil {
					_ = conn.Close()
				}
				return
			}
		}
		rp.ServeHTTP(w, r)
	}))
	obs := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(front), kvroute.WithObserver(obs), kvroute.WithClock(clk.Now))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	srv := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	ask := func(i int) kvroute.TurnRecord {
		t.Helper()
		conv.say(userText(i))
		body := conv.body()
		res := post(t, srv, conv.path, body, nil)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		assert.Equal(t, reference(t, conv.path, body), res.text)
		conv.hear(res.text)
		return obs.Last()
	}
	ask(1)
	broken.Store(true)
	// Turn 1's reading (its handle's block size: the one reader of
	// /metrics) is the check's too until it is as old as RestartCheck.
	clk.Advance(kvroute.Defaults().Health.RestartCheck)
	assert.Equal(t, kvroute.MissEngineUnconfirmed, ask(2).MissReason)
	before := reads.Load()
	// Within the check interval the engine is not read again.
	assert.Equal(t, kvroute.MissEngineUnconfirmed, ask(3).MissReason)
	assert.Equal(t, before, reads.Load(), "an unreadable engine is read once per interval")
	broken.Store(false)
	clk.Advance(2 * kvroute.Defaults().Health.RestartCheck)
	assert.Equal(t, kvroute.ReuseHit, ask(4).Reuse)
	assert.Zero(t, c.Decode[0].Stats().WrongOutputs)
}
