package kvroute_test

import (
	"bytes"
	"fmt"
	"io"
	"net/http"
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

func localModel(t *testing.T, c threshold.CostConfig) *threshold.CostModel {
	t.Helper()
	c.Static = true
	if c.Priors == (threshold.Rates{}) {
		// Pulling costs no more than recomputing for these short
		// conversations, as the engines' threshold of 64 tokens says.
		c.Priors = threshold.DefaultRates()
		c.Priors.PullFixed = time.Nanosecond
	}
	m, err := threshold.NewCostModel(c)
	require.NoError(t, err)
	return m
}

// TestDecodeLocalTurns: short turns go, as plain requests, to the decode
// engine that holds the conversation; P sees none of them; the handle of
// the last disaggregated turn stays retained and a long turn later pulls
// it, verified as usual. Every answer is the single engine's.
func TestDecodeLocalTurns(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 2, kvroutetest.WithStreamHandles(true))
			rec := &kvroutetest.Records{}
			r := newRouter(t, c, kvroute.WithObserver(rec), kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true, KVBytesPerToken: 1000}),
				kvroute.WithThresholdPolicy(localModel(t, threshold.CostConfig{MaxLocalSuffix: 400})))
			url := serve(t, r)
			conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 24,
				messages: []message{{Role: "system", Content: systemPrompt}}}
			long := strings.Repeat("go test output line with a failing assertion ", 60)
			recs := runTurns(t, url, rec, conv, 5, nil, func(turn int, cv *conversation) {
				if turn == 4 {
					cv.messages = append(cv.messages, message{Role: "user", Content: long})
				}
			})
			first := recs[0]
			require.True(t, first.Stored)
			for i, tr := range recs[1:4] {
				assert.Equal(t, kvroute.ReuseLocal, tr.Reuse, "turn %d: %s", i+1, tr.MissReason)
				assert.Equal(t, threshold.PathLocal, tr.Choice)
				assert.Positive(t, tr.EstimatedTTFT)
				assert.Equal(t, kvroute.RefuseDecodeLocal, tr.StoreRefusal)
				assert.Equal(t, first.DecodeEndpoint, tr.DecodeEndpoint, "the engine that holds the conversation")
				assert.Empty(t, tr.PrefillEndpoint)
				assert.Zero(t, tr.Prefill)
			}
			last := recs[4]
			assert.Equal(t, kvroute.ReuseHit, last.Reuse, last.MissReason)
			assert.Equal(t, threshold.PathPull, last.Choice)
			assert.Equal(t, threshold.RefuseLocalSuffix, last.LocalRefusal)
			assert.True(t, last.Stored)

			d := c.Decode[0]
			if first.DecodeEndpoint == c.Decode[1].URL() {
				d = c.Decode[1]
			}
			plain := roleRecords(d, "plain")
			require.Len(t, plain, 3)
			for _, p := range plain {
				assert.NotContains(t, string(p.Body), "kv_transfer_params", "a decode-local turn is a plain request")
				assert.Positive(t, p.CachedTokens, "D's prefix cache holds the conversation")
			}
			assert.Len(t, roleRecords(c.Prefill[0], "prefill"), 2, "P served turns 0 and 4 only")
			// Turn 4 verified against turn 0's handle, which the local
			// turns put back.
			assert.Zero(t, first.HandleTokens)
			assert.Equal(t, recs[1].HandleTokens, last.HandleTokens)
			for _, e := range append(c.Prefill, c.Decode...) {
				assert.Zero(t, e.Stats().WrongOutputs)
				assert.Zero(t, e.Stats().FreedReads)
			}
			s := r.Stats()
			assert.EqualValues(t, 3, s.ChoseLocal)
			assert.EqualValues(t, 1, s.ChosePull)
			assert.EqualValues(t, 3, s.PutBacks)

			var held int64
			for _, kv := range r.DecodeKV() {
				held += kv.Tokens
				if kv.Endpoint == last.DecodeEndpoint {
					assert.Equal(t, 1, kv.Handles)
					assert.Equal(t, kv.Tokens*1000, kv.Bytes)
				}
			}
			assert.Positive(t, held)
		})
	}
}

// gate holds plain chat requests (no kv_transfer_params) until released.
type gate struct {
	rt      http.RoundTripper
	mu      sync.Mutex
	waiting int
	open    chan struct{}
}

func (g *gate) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.URL.Path == kvroute.PathChatCompletions && req.Body != nil {
		b, err := io.ReadAll(req.Body)
		if err != nil {
			return nil, err
		}
		req.Body = io.NopCloser(bytes.NewReader(b))
		if !bytes.Contains(b, []byte("kv_transfer_params")) {
			g.mu.Lock()
			g.waiting++
			g.mu.Unlock()
			<-g.open
		}
	}
	return g.rt.RoundTrip(req)
}

func (g *gate) held() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.waiting
}

// TestDecodeLocalBurstBounded: five conversations send a short turn at
// once; their decode engine takes two decode-local prefills (the bound),
// the other three pull as before, and every answer is right.
func TestDecodeLocalBurstBounded(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	rt := http.DefaultTransport.(*http.Transport).Clone()
	t.Cleanup(rt.CloseIdleConnections)
	g := &gate{rt: rt, open: make(chan struct{})}
	rec := &kvroutetest.Records{}
	r := newRouter(t, c, kvroute.WithObserver(rec), kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true}), kvroute.WithTransport(g),
		kvroute.WithThresholdPolicy(localModel(t, threshold.CostConfig{MaxLocalInFlight: 2})))
	url := serve(t, r)
	const n = 5
	convs := make([]*conversation, n)
	for i := range convs {
		convs[i] = &conversation{path: kvroute.PathChatCompletions, maxTok: 24,
			messages: []message{{Role: "system", Content: fmt.Sprintf("%s Session %d.", systemPrompt, i)}}}
		convs[i].say(userText(0))
		res := post(t, url, convs[i].path, convs[i].body(), nil)
		require.Equal(t, http.StatusOK, res.status)
		convs[i].hear(res.text)
		convs[i].say(userText(1))
	}
	var wg sync.WaitGroup
	texts := make([]string, n)
	for i, cv := range convs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			res := post(t, url, cv.path, cv.body(), nil)
			assert.Equal(t, http.StatusOK, res.status)
			texts[i] = res.text
		}()
	}
	require.Eventually(t, func() bool { return g.held() == 2 && r.Stats().LocalBusy == n-2 },
		10*time.Second, time.Millisecond, "two decode-local legs held, three refused as busy")
	close(g.open)
	wg.Wait()
	for i, cv := range convs {
		want, err := kvroutetest.Reference(cv.path, cv.body())
		require.NoError(t, err)
		assert.Equal(t, want.Text, texts[i], "conversation %d", i)
	}
	s := r.Stats()
	assert.EqualValues(t, 2, s.ChoseLocal)
	assert.EqualValues(t, n-2, s.ChosePull)
	assert.EqualValues(t, n-2, s.LocalBusy)
	assert.Zero(t, c.Decode[0].Stats().WrongOutputs)
}

// learner records what the router reports to a learning Chooser.
type learner struct {
	*threshold.CostModel
	mu  sync.Mutex
	obs []threshold.Observation
}

func (l *learner) Observe(o threshold.Observation) {
	l.mu.Lock()
	l.obs = append(l.obs, o)
	l.mu.Unlock()
	l.CostModel.Observe(o)
}

// TestDecodeLocalObserved: the router reports each streaming turn it chose
// a path for, with the path, token counts and times on its clock.
func TestDecodeLocalObserved(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	rec := &kvroutetest.Records{}
	l := &learner{CostModel: localModel(t, threshold.CostConfig{})}
	r := newRouter(t, c, kvroute.WithObserver(rec), kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true}), kvroute.WithThresholdPolicy(l))
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, stream: true, maxTok: 24,
		messages: []message{{Role: "system", Content: systemPrompt}}}
	recs := runTurns(t, url, rec, conv, 3, nil, nil)
	l.mu.Lock()
	defer l.mu.Unlock()
	require.Len(t, l.obs, 2, "turns 1 and 2 had a verified handle")
	for i, o := range l.obs {
		tr := recs[i+1]
		assert.Equal(t, threshold.PathLocal, o.Path)
		assert.Equal(t, tr.DecodeEndpoint, o.Decode)
		assert.Equal(t, tr.PromptTokens, o.PromptTokens)
		assert.Equal(t, tr.VerifiedTokens, o.ReusableTokens)
		assert.Zero(t, o.Prefill)
		assert.Positive(t, o.DecodeFirst)
		assert.LessOrEqual(t, o.DecodeFirst, tr.TTFT)
	}
}

// TestDecodeLocalTraced: a decode-local turn's phases are the lookup (and
// its render call) and one decode leg to the engine that holds the
// conversation, with no prefill.
func TestDecodeLocalTraced(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	ft := &fakeTracer{}
	url := serve(t, newRouter(t, c, kvroute.WithTracer(ft), kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true}),
		kvroute.WithThresholdPolicy(localModel(t, threshold.CostConfig{}))))
	conv := &conversation{path: kvroute.PathChatCompletions, stream: true, maxTok: 8, messages: []message{{Role: "system", Content: systemPrompt}}}
	hdr := http.Header{"Traceparent": {"client-trace"}}
	for i := range 2 {
		conv.say(userText(i))
		res := post(t, url, conv.path, conv.body(), hdr)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		conv.hear(res.text)
	}
	spans := ft.take()
	var local []fakeSpan
	for i, s := range spans {
		if s.name == "turn" && i > 0 {
			local = spans[i:]
		}
	}
	require.NotEmpty(t, local)
	assert.Equal(t, []string{"turn", "lookup", "verify", "decode", "stream"}, spanNames(local))
	assert.Equal(t, kvroute.ReuseLocal, local[0].rec.Reuse)
	for _, s := range local {
		assert.Equal(t, 1, s.ended, "%s ended", s.name)
		assert.NoError(t, s.err, s.name)
	}
}
