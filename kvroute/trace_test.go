package kvroute_test

import (
	"context"
	"net/http"
	"strconv"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
)

// fakeSpan is one span of fakeTracer.
type fakeSpan struct {
	id, parent string
	name       string // "turn" or a phase
	endpoint   string
	ended      int
	err        error
	rec        kvroute.TurnRecord // the turn's record, for "turn"
}

type spanKey struct{}

// fakeTracer records spans and injects "fake-<span id>" as the trace
// header; a turn's parent is the client's Traceparent, if any.
type fakeTracer struct {
	mu    sync.Mutex
	spans []*fakeSpan
	n     int // spans started
}

func (f *fakeTracer) add(ctx context.Context, name, parent, endpoint string) (context.Context, *fakeSpan) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	s := &fakeSpan{id: strconv.Itoa(f.n), parent: parent, name: name, endpoint: endpoint}
	f.spans = append(f.spans, s)
	return context.WithValue(ctx, spanKey{}, s.id), s
}

func (f *fakeTracer) StartTurn(ctx context.Context, req *kvroute.Request) (context.Context, func(*kvroute.TurnRecord)) {
	ctx, s := f.add(ctx, "turn", req.Header.Get("Traceparent"), "")
	return ctx, func(rec *kvroute.TurnRecord) {
		f.mu.Lock()
		defer f.mu.Unlock()
		s.ended++
		s.rec = *rec
	}
}

func (f *fakeTracer) StartPhase(ctx context.Context, phase kvroute.Phase, endpoint string) (context.Context, func(error)) {
	parent, _ := ctx.Value(spanKey{}).(string)
	ctx, s := f.add(ctx, string(phase), parent, endpoint)
	return ctx, func(err error) {
		f.mu.Lock()
		defer f.mu.Unlock()
		s.ended++
		s.err = err
	}
}

func (f *fakeTracer) Inject(ctx context.Context, h http.Header) {
	id, _ := ctx.Value(spanKey{}).(string)
	h.Set("Traceparent", "fake-"+id)
}

// take returns the spans recorded since the last call.
func (f *fakeTracer) take() []fakeSpan {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make([]fakeSpan, len(f.spans))
	for i, s := range f.spans {
		out[i] = *s
	}
	f.spans = nil
	return out
}

// TestTracerPhases checks what the router tells a Tracer for a miss and a
// hit turn, streaming and not: the phases, their parents and endpoints,
// each ended once, and the trace header each engine request carried.
func TestTracerPhases(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run("stream="+strconv.FormatBool(stream), func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
			ft := &fakeTracer{}
			url := serve(t, newRouter(t, c, kvroute.WithTracer(ft)))
			conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 8, messages: []message{{Role: "system", Content: systemPrompt}}}
			hdr := http.Header{"Traceparent": {"client-trace"}}

			conv.say(userText(0))
			res := post(t, url, conv.path, conv.body(), hdr)
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			conv.hear(res.text)
			miss := ft.take()
			names := spanNames(miss)
			if stream {
				assert.Equal(t, []string{"turn", "lookup", "prefill", "decode", "stream"}, names)
			} else {
				assert.Equal(t, []string{"turn", "lookup", "prefill", "decode"}, names)
			}
			checkSpans(t, miss, c)
			assert.Equal(t, kvroute.ReuseMiss, miss[0].rec.Reuse)

			conv.say(userText(1))
			res = post(t, url, conv.path, conv.body(), hdr)
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			hit := ft.take()
			if stream {
				assert.Equal(t, []string{"turn", "lookup", "verify", "prefill", "decode", "stream"}, spanNames(hit))
			} else {
				assert.Equal(t, []string{"turn", "lookup", "verify", "prefill", "decode"}, spanNames(hit))
			}
			checkSpans(t, hit, c)
			assert.Equal(t, kvroute.ReuseHit, hit[0].rec.Reuse)
			assert.Positive(t, hit[0].rec.ReusableTokens)

			// Each engine request carried its own phase's span, never the
			// client's header.
			byID := map[string]fakeSpan{}
			for _, s := range append(miss, hit...) {
				byID[s.id] = s
			}
			var seen []string
			for _, e := range append(append([]*kvroutetest.Engine(nil), c.Prefill...), c.Decode...) {
				for _, rr := range e.Requests() {
					tp := rr.Header.Get("Traceparent")
					require.Len(t, rr.Header.Values("Traceparent"), 1)
					s, ok := byID[tp[len("fake-"):]]
					require.True(t, ok, "engine %s got Traceparent %q", rr.Role, tp)
					assert.Equal(t, e.URL(), s.endpoint)
					want := map[string]string{"prefill": "prefill", "decode": "decode", "render": "verify"}[rr.Role]
					assert.Equal(t, want, s.name, "role %s", rr.Role)
					seen = append(seen, rr.Role)
				}
			}
			assert.ElementsMatch(t, []string{"prefill", "decode", "render", "prefill", "decode"}, seen)
		})
	}
}

func spanNames(spans []fakeSpan) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.name)
	}
	return out
}

// checkSpans checks one turn's spans: the turn first, its parent the
// client's header; each phase ended once under the right parent, naming
// its engine.
func checkSpans(t *testing.T, spans []fakeSpan, c *kvroutetest.Cluster) {
	t.Helper()
	require.NotEmpty(t, spans)
	turn := spans[0]
	assert.Equal(t, "client-trace", turn.parent)
	ids := map[string]fakeSpan{}
	for _, s := range spans {
		ids[s.name] = s
		assert.Equal(t, 1, s.ended, "%s ended", s.name)
		assert.NoError(t, s.err, s.name)
	}
	parent := map[string]string{"lookup": "turn", "verify": "lookup", "prefill": "turn", "decode": "turn", "stream": "decode"}
	for _, s := range spans[1:] {
		assert.Equal(t, ids[parent[s.name]].id, s.parent, "parent of %s", s.name)
	}
	assert.Empty(t, ids["lookup"].endpoint)
	assert.Equal(t, c.Prefill[0].URL(), ids["prefill"].endpoint)
	assert.Equal(t, c.Decode[0].URL(), ids["decode"].endpoint)
	if s, ok := ids["stream"]; ok {
		assert.Equal(t, c.Decode[0].URL(), s.endpoint)
	}
	if s, ok := ids["verify"]; ok {
		assert.Equal(t, c.Prefill[0].URL(), s.endpoint)
	}
}

// TestTracerFailedPrefill: a failed prefill attempt ends its phase with
// the error; a retried one gets its own phase; a turn that fails reports
// it to the turn's end.
func TestTracerFailedPrefill(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	ft := &fakeTracer{}
	policy := transport.RetryPolicy{MaxAttempts: 2, InitialInterval: 1, MaxInterval: 1}
	url := serve(t, newRouter(t, c, kvroute.WithTracer(ft), kvroute.WithFailover(kvroute.Failover{PrefillRetry: policy})))
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8}
	conv.say(userText(0))

	c.Prefill[0].FailNext(1, http.StatusServiceUnavailable)
	res := post(t, url, conv.path, conv.body(), nil)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	spans := ft.take()
	require.Equal(t, []string{"turn", "lookup", "prefill", "prefill", "decode"}, spanNames(spans))
	var ue *kvroute.UpstreamError
	require.ErrorAs(t, spans[2].err, &ue)
	assert.Equal(t, kvroute.PhasePrefill, ue.Phase)
	assert.Equal(t, http.StatusServiceUnavailable, ue.Status)
	assert.NoError(t, spans[3].err)
	assert.NoError(t, spans[0].rec.Err)

	c.Prefill[0].FailNext(2, http.StatusServiceUnavailable)
	res = post(t, url, conv.path, conv.body(), nil)
	require.Equal(t, http.StatusServiceUnavailable, res.status, "P's 503 reaches the client as 503: %s", res.raw)
	assert.Equal(t, "1", res.header.Get("Retry-After"))
	spans = ft.take()
	require.Equal(t, []string{"turn", "lookup", "prefill", "prefill"}, spanNames(spans))
	for _, s := range spans {
		assert.Equal(t, 1, s.ended, s.name)
	}
	assert.Error(t, spans[2].err)
	assert.Error(t, spans[3].err)
	assert.Equal(t, kvroute.PhasePrefill, spans[0].rec.ErrPhase)
	assert.Error(t, spans[0].rec.Err)
}

// TestTracerOff: without a Tracer the client's trace headers reach both
// engines as sent.
func TestTracerOff(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	url := serve(t, newRouter(t, c))
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8}
	conv.say(userText(0))
	const tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
	hdr := http.Header{"Traceparent": {tp}, "Tracestate": {"congo=t61rcWkgMzE"}}
	res := post(t, url, conv.path, conv.body(), hdr)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	for _, e := range []*kvroutetest.Engine{c.Prefill[0], c.Decode[0]} {
		recs := e.Requests()
		require.Len(t, recs, 1)
		assert.Equal(t, []string{tp}, recs[0].Header.Values("Traceparent"))
		assert.Equal(t, []string{"congo=t61rcWkgMzE"}, recs[0].Header.Values("Tracestate"))
	}
}

func TestWithTracerNil(t *testing.T) {
	_, err := kvroute.New(kvroute.WithPrefill("127.0.0.1:1"), kvroute.WithDecode("127.0.0.1:2"), kvroute.WithTracer(nil))
	require.ErrorIs(t, err, kvroute.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "WithTracer")
}
