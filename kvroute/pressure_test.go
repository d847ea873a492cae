package kvroute_test

import (
	"context"
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

// Issue 23.4: LeastLoaded places by pressure: a crowded engine (KV memory
// above the high watermark, or preempting) loses its conversations'
// affinity while another has room, and new conversations go where there
// is room; when every engine is crowded nothing changes.
func TestLeastLoadedPressure(t *testing.T) {
	ctx := context.Background()
	crowd := func(c []kvroute.Candidate, idx ...int) []kvroute.Candidate {
		for _, i := range idx {
			c[i].Crowded, c[i].KVUsage = true, 0.95
		}
		return c
	}
	a1 := "http://10.0.0.1:8000"
	tests := []struct {
		name string
		s    kvroute.Selection
		want []int
	}{
		{"affinity yields when crowded", kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: crowd(cands(0, 3, 5), 0), Affinity: a1}, []int{1}},
		{"affinity kept when every engine is crowded", kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: crowd(cands(2, 0, 0), 0, 1, 2), Affinity: a1}, []int{0}},
		{"affinity kept when not crowded", kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: crowd(cands(2, 0, 0), 1, 2), Affinity: a1}, []int{0}},
		{"new conversations go where there is room", kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: crowd(cands(0, 4, 0), 0, 2)}, []int{1}},
		{"waiting breaks ties", kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: func() []kvroute.Candidate {
			c := cands(1, 1, 1)
			c[0].Waiting, c[2].Waiting = 3, 2
			return c
		}()}, []int{1}},
		{"KV usage breaks ties", kvroute.Selection{Phase: kvroute.PhaseDecode, Candidates: func() []kvroute.Candidate {
			c := cands(1, 1, 1)
			c[0].KVUsage, c[1].KVUsage, c[2].KVUsage = 0.5, 0.6, 0.1
			return c
		}()}, []int{2}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			sel := &kvroute.LeastLoaded{MaxInFlight: 8}
			for range 50 {
				i, err := sel.Select(ctx, &tt.s)
				require.NoError(t, err)
				assert.Contains(t, tt.want, i)
			}
		})
	}
}

// End to end: the decode selector sees each engine's pressure, read from
// its /metrics and corrected by the holds retained since. With a low high
// watermark, the engine that holds one conversation is crowded by that
// hold and a new conversation is placed on the other, whatever the
// rotation; the first conversation's next turn still attaches its KV.
// Every answer is a single engine's.
func TestPlacementByPressure(t *testing.T) {
	for range 4 { // the rotation starts anywhere: placement must not depend on it
		clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
		c := kvroutetest.NewCluster(t, 1, 2, kvroutetest.WithStreamHandles(true), kvroutetest.WithClock(clk),
			kvroutetest.WithNumBlocks(budgetBlocks))
		rec := &kvroutetest.Records{}
		r := newRouter(t, c, kvroute.WithObserver(rec), kvroute.WithDecodeMemory(kvroute.DecodeMemory{HighWatermark: 0.05}))
		url := serve(t, r)
		convs := []*conversation{}
		var engines []string
		for i := range 2 {
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
			conv.say(userText(i + 1))
			conv.hear(releaseTurn(t, url, conv.path, conv.body(), nil))
			engines = append(engines, rec.Last().DecodeEndpoint)
			convs = append(convs, conv)
			if i == 0 {
				knowCapacity(t, r)
			}
		}
		assert.NotEqual(t, engines[0], engines[1], "the new conversation went to the engine with room")
		convs[0].say(userText(3))
		releaseTurn(t, url, convs[0].path, convs[0].body(), nil)
		assert.Equal(t, kvroute.ReuseHit, rec.Last().Reuse, "%s", rec.Last().MissReason)
		for _, d := range c.Decode {
			assert.Zero(t, d.Stats().WrongOutputs)
		}
	}
}

// One reader of /metrics: with restart detection and decode memory both
// on, at the same interval, a decode engine's /metrics is read once per
// interval however many turns ask for it (the restart check before each
// attach, the pressure reading at each placement, the block size of its
// handles): each counts the one reading as its own.
func TestOneMetricsReadPerInterval(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(1_700_000_000, 0))
	c := restartCluster(t, true, kvroutetest.WithClock(clk))
	u, err := url.Parse(c.Decode[0].URL())
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	var reads atomic.Int32
	front := newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" {
			reads.Add(1)
		}
		rp.ServeHTTP(w, r)
	}))
	obs := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(front), kvroute.WithObserver(obs), kvroute.WithClock(clk.Now),
		kvroute.WithHealth(kvroute.Health{RestartCheck: time.Second}), kvroute.WithDecodeMemory(kvroute.DecodeMemory{MetricsInterval: time.Second}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	srv := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	turn := 0
	for interval := range 3 {
		for range 4 {
			turn++
			conv.say(userText(turn))
			body := conv.body()
			res := post(t, srv, conv.path, body, nil)
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			assert.Equal(t, reference(t, conv.path, body), res.text)
			conv.hear(res.text)
			if turn > 1 {
				assert.Equal(t, kvroute.ReuseHit, obs.Last().Reuse, "turn %d: %s", turn, obs.Last().MissReason)
			}
		}
		want := int32(interval + 1)
		require.Eventually(t, func() bool { return reads.Load() >= want }, 5*time.Second, time.Millisecond)
		time.Sleep(50 * time.Millisecond) // a second read, if any, would be running by now
		assert.Equal(t, want, reads.Load(), "interval %d: one read of /metrics", interval)
		clk.Advance(time.Second)
	}
	assert.Positive(t, r.DecodeKV()[0].Capacity, "the pressure reading took the one read")
}
