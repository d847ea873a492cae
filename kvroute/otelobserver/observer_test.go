package otelobserver_test

import (
	"context"
	"net/http"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	"go.opentelemetry.io/otel/sdk/metric/metricdata"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/kvroute/otelobserver"
	"github.com/bidikv/bidikv/transport"
)

// A client's trace context, as a caller that traces would send it.
const (
	clientTrace  = "4bf92f3577b34da6a3ce929d0e0e4736"
	clientSpan   = "00f067aa0ba902b7"
	clientHeader = "00-" + clientTrace + "-" + clientSpan + "-01"
)

// attrs returns a span's attributes by key.
func attrs(s tracetest.SpanStub) map[attribute.Key]attribute.Value {
	m := map[attribute.Key]attribute.Value{}
	for _, kv := range s.Attributes {
		m[kv.Key] = kv.Value
	}
	return m
}

// byName returns the spans of one trace by name, failing on a name seen
// twice.
func byName(t *testing.T, spans tracetest.SpanStubs) map[string]tracetest.SpanStub {
	t.Helper()
	m := map[string]tracetest.SpanStub{}
	for _, s := range spans {
		_, dup := m[s.Name]
		require.False(t, dup, "span %s twice", s.Name)
		m[s.Name] = s
	}
	return m
}

func names(spans tracetest.SpanStubs) []string {
	var out []string
	for _, s := range spans {
		out = append(out, s.Name)
	}
	return out
}

// TestTurnTrace runs a miss then a hit turn, streaming and not, with the
// client's traceparent, and checks each turn's spans (names, parents,
// kinds, attributes) and the trace context every engine request carried.
func TestTurnTrace(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run("stream="+strconv.FormatBool(stream), func(t *testing.T) {
			g := newRig(t)
			conv := newConversation(stream)
			hdr := http.Header{"Traceparent": {clientHeader}, "Tracestate": {"congo=t61rcWkgMzE"}}

			status, reuse := conv.turn(t, g.url, "List the files.", hdr)
			require.Equal(t, http.StatusOK, status)
			require.Equal(t, string(kvroute.ReuseMiss), reuse)
			miss := g.take()
			want := []string{otelobserver.SpanLookup, otelobserver.SpanPrefill, otelobserver.SpanDecode, otelobserver.SpanTurn}
			if stream {
				want = []string{otelobserver.SpanLookup, otelobserver.SpanPrefill, otelobserver.SpanStream, otelobserver.SpanDecode, otelobserver.SpanTurn}
			}
			assert.Equal(t, want, names(miss), "spans in the order they ended")
			m := checkTurn(t, g, miss, stream)
			a := attrs(m[otelobserver.SpanTurn])
			assert.Equal(t, string(kvroute.ReuseMiss), a[otelobserver.AttrReuse].AsString())
			assert.Equal(t, string(kvroute.MissNotFound), a[otelobserver.AttrMissReason].AsString())
			assert.Equal(t, int64(0), a[otelobserver.AttrReusableTokens].AsInt64())
			assert.Equal(t, true, a[otelobserver.AttrStored].AsBool())
			checkEngines(t, g, miss, 0)

			status, reuse = conv.turn(t, g.url, "Run the tests.", hdr)
			require.Equal(t, http.StatusOK, status)
			require.Equal(t, string(kvroute.ReuseHit), reuse)
			hit := g.take()
			m = checkTurn(t, g, hit, stream)
			require.Contains(t, m, otelobserver.SpanVerify)
			a = attrs(m[otelobserver.SpanTurn])
			assert.Equal(t, string(kvroute.ReuseHit), a[otelobserver.AttrReuse].AsString())
			assert.NotContains(t, a, otelobserver.AttrMissReason)
			assert.Positive(t, a[otelobserver.AttrReusableTokens].AsInt64())
			assert.Positive(t, a[otelobserver.AttrVerifiedTokens].AsInt64())
			assert.GreaterOrEqual(t, a[otelobserver.AttrVerifiedTokens].AsInt64(), a[otelobserver.AttrReusableTokens].AsInt64())
			assert.Equal(t, string(kvroute.VerifyTokens), a[otelobserver.AttrVerification].AsString())
			assert.Equal(t, string(kvroute.TokensFromRender), a[otelobserver.AttrTokenSource].AsString())
			assert.Positive(t, a[otelobserver.AttrPromptTokens].AsInt64())
			checkEngines(t, g, hit, 1)
		})
	}
}

// checkTurn checks one turn's spans: one trace, the client's; the turn a
// server span whose parent is the client's span; each phase under its
// parent, naming its engine. It returns the spans by name.
func checkTurn(t *testing.T, g *rig, spans tracetest.SpanStubs, stream bool) map[string]tracetest.SpanStub {
	t.Helper()
	m := byName(t, spans)
	turn, ok := m[otelobserver.SpanTurn]
	require.True(t, ok, "no turn span in %v", names(spans))
	assert.Equal(t, clientTrace, turn.SpanContext.TraceID().String())
	assert.Equal(t, clientSpan, turn.Parent.SpanID().String())
	assert.True(t, turn.Parent.IsRemote())
	assert.Equal(t, trace.SpanKindServer, turn.SpanKind)
	assert.Equal(t, codes.Unset, turn.Status.Code)
	parents := map[string]string{
		otelobserver.SpanLookup:  otelobserver.SpanTurn,
		otelobserver.SpanVerify:  otelobserver.SpanLookup,
		otelobserver.SpanPrefill: otelobserver.SpanTurn,
		otelobserver.SpanDecode:  otelobserver.SpanTurn,
		otelobserver.SpanStream:  otelobserver.SpanDecode,
	}
	kinds := map[string]trace.SpanKind{
		otelobserver.SpanLookup: trace.SpanKindInternal, otelobserver.SpanStream: trace.SpanKindInternal,
		otelobserver.SpanVerify: trace.SpanKindClient, otelobserver.SpanPrefill: trace.SpanKindClient, otelobserver.SpanDecode: trace.SpanKindClient,
	}
	endpoints := map[string]string{
		otelobserver.SpanVerify: g.c.Prefill[0].URL(), otelobserver.SpanPrefill: g.c.Prefill[0].URL(),
		otelobserver.SpanDecode: g.c.Decode[0].URL(), otelobserver.SpanStream: g.c.Decode[0].URL(),
	}
	for name, s := range m {
		assert.Equal(t, clientTrace, s.SpanContext.TraceID().String(), name)
		if name == otelobserver.SpanTurn {
			continue
		}
		p := m[parents[name]]
		assert.Equal(t, p.SpanContext.SpanID(), s.Parent.SpanID(), "parent of %s", name)
		assert.False(t, s.StartTime.Before(p.StartTime), "%s starts within its parent", name)
		assert.False(t, s.EndTime.After(turn.EndTime), "%s ends within the turn", name)
		assert.Equal(t, kinds[name], s.SpanKind, name)
		assert.Equal(t, codes.Unset, s.Status.Code, name)
		assert.Equal(t, endpoints[name], attrs(s)[otelobserver.AttrEndpoint].AsString(), name)
	}
	_, hasStream := m[otelobserver.SpanStream]
	assert.Equal(t, stream, hasStream)
	a := attrs(turn)
	assert.Equal(t, g.c.Prefill[0].URL(), a[otelobserver.AttrPrefillURL].AsString())
	assert.Equal(t, g.c.Decode[0].URL(), a[otelobserver.AttrDecodeURL].AsString())
	assert.Equal(t, kvroute.PathChatCompletions, a[otelobserver.AttrRoute].AsString())
	assert.Equal(t, stream, a[otelobserver.AttrStream].AsBool())
	assert.Positive(t, a[otelobserver.AttrTTFTMS].AsFloat64())
	assert.NotEmpty(t, a[otelobserver.AttrRequestID].AsString())
	return m
}

// checkEngines checks the trace context of turn i's engine requests: the
// turn's trace, with its phase span as the parent, and the client's own
// headers replaced.
func checkEngines(t *testing.T, g *rig, spans tracetest.SpanStubs, i int) {
	t.Helper()
	m := byName(t, spans)
	want := map[string]string{"prefill": otelobserver.SpanPrefill, "decode": otelobserver.SpanDecode, "render": otelobserver.SpanVerify}
	var roles []string
	for _, e := range []*kvroutetest.Engine{g.c.Prefill[0], g.c.Decode[0]} {
		for _, rr := range e.Requests() {
			sc := engineTrace(rr)
			if sc.SpanID() == m[otelobserver.SpanTurn].SpanContext.SpanID() || !containsSpan(spans, sc.SpanID()) {
				continue // another turn's
			}
			roles = append(roles, rr.Role)
			phase := m[want[rr.Role]]
			assert.Equal(t, phase.SpanContext.TraceID(), sc.TraceID(), rr.Role)
			assert.Equal(t, phase.SpanContext.SpanID(), sc.SpanID(), "%s: parent is its phase span", rr.Role)
			assert.True(t, sc.IsSampled())
			assert.Len(t, rr.Header.Values("Traceparent"), 1)
			// The client's tracestate goes on with its trace, as W3C
			// Trace Context has it, in the header the propagator wrote.
			assert.Equal(t, []string{phase.SpanContext.TraceState().String()}, rr.Header.Values("Tracestate"))
			assert.Equal(t, "congo=t61rcWkgMzE", phase.SpanContext.TraceState().String())
			assert.NotEqual(t, clientHeader, rr.Header.Get("Traceparent"))
		}
	}
	if i == 0 {
		assert.ElementsMatch(t, []string{"prefill", "decode"}, roles)
	} else {
		assert.ElementsMatch(t, []string{"render", "prefill", "decode"}, roles)
	}
	// Every engine request of the rig carries some trace of this rig.
	for _, e := range []*kvroutetest.Engine{g.c.Prefill[0], g.c.Decode[0]} {
		for _, rr := range e.Requests() {
			assert.Equal(t, clientTrace, engineTrace(rr).TraceID().String(), rr.Role)
		}
	}
}

func containsSpan(spans tracetest.SpanStubs, id trace.SpanID) bool {
	for _, s := range spans {
		if s.SpanContext.SpanID() == id {
			return true
		}
	}
	return false
}

// TestFailedPrefill: a prefill that fails ends its span with status Error,
// the engine's status and the error recorded; the turn span names the
// failed phase; a retried attempt gets a span of its own.
func TestFailedPrefill(t *testing.T) {
	g := newRig(t, kvroute.WithFailover(kvroute.Failover{PrefillRetry: transport.RetryPolicy{MaxAttempts: 2, InitialInterval: 1, MaxInterval: 1}}))
	conv := newConversation(false)

	g.c.Prefill[0].FailNext(2, http.StatusServiceUnavailable)
	status, _ := conv.turn(t, g.url, "List the files.", nil)
	require.Equal(t, http.StatusServiceUnavailable, status, "P's 503 reaches the client as 503")
	spans := g.take()
	require.Equal(t, []string{otelobserver.SpanLookup, otelobserver.SpanPrefill, otelobserver.SpanPrefill, otelobserver.SpanTurn}, names(spans))
	turn := spans[3]
	assert.Equal(t, codes.Error, turn.Status.Code)
	assert.Contains(t, turn.Status.Description, "prefill")
	assert.Equal(t, string(kvroute.PhasePrefill), attrs(turn)[otelobserver.AttrErrorPhase].AsString())
	assert.False(t, turn.Parent.IsValid(), "no inbound trace: a root span")
	for _, s := range spans[1:3] {
		assert.Equal(t, codes.Error, s.Status.Code)
		assert.Contains(t, s.Status.Description, "status 503")
		assert.Equal(t, int64(http.StatusServiceUnavailable), attrs(s)["http.response.status_code"].AsInt64())
		require.Len(t, s.Events, 1)
		assert.Equal(t, "exception", s.Events[0].Name)
		assert.Equal(t, turn.SpanContext.SpanID(), s.Parent.SpanID())
	}
	assert.NotEqual(t, spans[1].SpanContext.SpanID(), spans[2].SpanContext.SpanID())

	// One failed attempt, then a good one: the turn succeeds.
	g.c.Prefill[0].FailNext(1, http.StatusServiceUnavailable)
	status, _ = conv.turn(t, g.url, "List the files.", nil)
	require.Equal(t, http.StatusOK, status)
	spans = g.take()
	require.Equal(t, []string{otelobserver.SpanLookup, otelobserver.SpanPrefill, otelobserver.SpanPrefill, otelobserver.SpanDecode, otelobserver.SpanTurn}, names(spans))
	assert.Equal(t, codes.Error, spans[1].Status.Code)
	assert.Equal(t, codes.Unset, spans[2].Status.Code)
	assert.Equal(t, codes.Unset, spans[4].Status.Code)
	assert.Equal(t, int64(2), attrs(spans[4])[otelobserver.AttrAttempts].AsInt64())
}

// TestParentFromContext: a span in Do's context is the turn's parent (the
// client's header is then ignored) and the turn span is internal.
func TestParentFromContext(t *testing.T) {
	g := newRig(t)
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	ctx, parent := tp.Tracer("caller").Start(context.Background(), "caller")
	conv := newConversation(false)
	req := &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{"Traceparent": {clientHeader}}, Body: conv.body("List the files.")}
	resp, err := g.router.Do(ctx, req)
	require.NoError(t, err)
	require.NoError(t, resp.Close())
	parent.End()
	m := byName(t, g.take())
	turn := m[otelobserver.SpanTurn]
	assert.Equal(t, parent.SpanContext().TraceID(), turn.SpanContext.TraceID())
	assert.Equal(t, parent.SpanContext().SpanID(), turn.Parent.SpanID())
	assert.Equal(t, trace.SpanKindInternal, turn.SpanKind)
	for _, rr := range g.c.Decode[0].Requests() {
		assert.Equal(t, m[otelobserver.SpanDecode].SpanContext.SpanID(), engineTrace(rr).SpanID())
	}
}

// TestNoopProviderPassesContext: without a TracerProvider nothing is
// recorded, and the engines get the client's trace context (the no-op
// tracer keeps the parent's).
func TestNoopProviderPassesContext(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	o, err := otelobserver.New()
	require.NoError(t, err)
	r, err := kvroute.New(append([]kvroute.Option{kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(c.Decode[0].URL())}, o.Options()...)...)
	require.NoError(t, err)
	defer r.Close()
	conv := newConversation(false)
	resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{"Traceparent": {clientHeader}}, Body: conv.body("hi")})
	require.NoError(t, err)
	require.NoError(t, resp.Close())
	for _, e := range []*kvroutetest.Engine{c.Prefill[0], c.Decode[0]} {
		recs := e.Requests()
		require.Len(t, recs, 1)
		assert.Equal(t, clientHeader, recs[0].Header.Get("Traceparent"))
	}
}

// TestMetrics checks the instruments after a miss, a hit and a failed
// turn.
func TestMetrics(t *testing.T) {
	g := newRig(t, kvroute.WithFailover(kvroute.Failover{PrefillRetry: transport.RetryPolicy{MaxAttempts: 1}}))
	conv := newConversation(true)
	status, _ := conv.turn(t, g.url, "List the files.", nil)
	require.Equal(t, http.StatusOK, status)
	g.take()
	status, _ = conv.turn(t, g.url, "Run the tests.", nil)
	require.Equal(t, http.StatusOK, status)
	hit := attrs(byName(t, g.take())[otelobserver.SpanTurn])
	// The third turn's prefill carries a handle and fails: the handle is
	// spent, so the turn is a miss (retry), failed in the prefill phase.
	g.c.Prefill[0].FailNext(1, http.StatusServiceUnavailable)
	status, _ = conv.turn(t, g.url, "Again.", nil)
	require.Equal(t, http.StatusServiceUnavailable, status, "P's 503 reaches the client as 503")

	var rm metricdata.ResourceMetrics
	require.NoError(t, g.reader.Collect(context.Background(), &rm))
	got := map[string]metricdata.Metrics{}
	for _, sm := range rm.ScopeMetrics {
		assert.Equal(t, otelobserver.ScopeName, sm.Scope.Name)
		for _, mm := range sm.Metrics {
			got[mm.Name] = mm
		}
	}
	turns := got[otelobserver.MetricTurns].Data.(metricdata.Sum[int64])
	counts := map[string]int64{}
	for _, dp := range turns.DataPoints {
		reuse, _ := dp.Attributes.Value(otelobserver.AttrReuse)
		reason, _ := dp.Attributes.Value(otelobserver.AttrMissReason)
		phase, _ := dp.Attributes.Value(otelobserver.AttrErrorPhase)
		counts[reuse.AsString()+"/"+reason.AsString()+"/"+phase.AsString()] += dp.Value
	}
	assert.Equal(t, map[string]int64{"miss/not_found/": 1, "hit//": 1, "miss/retry/prefill": 1}, counts)

	ttft := got[otelobserver.MetricTTFT].Data.(metricdata.Histogram[float64])
	var n uint64
	for _, dp := range ttft.DataPoints {
		n += dp.Count
		assert.Positive(t, dp.Sum)
	}
	assert.Equal(t, uint64(2), n, "TTFT of the two turns that succeeded")

	tok := got[otelobserver.MetricReuseTokens].Data.(metricdata.Histogram[int64])
	require.Len(t, tok.DataPoints, 1)
	assert.Equal(t, uint64(1), tok.DataPoints[0].Count)
	assert.Equal(t, hit[otelobserver.AttrReusableTokens].AsInt64(), tok.DataPoints[0].Sum)

	dur := got[otelobserver.MetricTurnDuration].Data.(metricdata.Histogram[float64])
	n = 0
	for _, dp := range dur.DataPoints {
		n += dp.Count
	}
	assert.Equal(t, uint64(3), n)
	for _, name := range []string{otelobserver.MetricPrefillDuration, otelobserver.MetricFirstByte, otelobserver.MetricPrefillAttempts, otelobserver.MetricResponseSize} {
		assert.Contains(t, got, name)
	}
}

func TestEndpointEvents(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	o, err := otelobserver.New(otelobserver.WithMeterProvider(mp))
	require.NoError(t, err)
	o.ObserveEndpoint(kvroute.EndpointEvent{Phase: kvroute.PhasePrefill, Endpoint: "http://127.0.0.1:1", Kind: kvroute.EndpointEjected})
	o.ObserveEndpoint(kvroute.EndpointEvent{Phase: kvroute.PhasePrefill, Endpoint: "http://127.0.0.1:1", Kind: kvroute.EndpointEjected})
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	require.Len(t, rm.ScopeMetrics, 1)
	var found bool
	for _, mm := range rm.ScopeMetrics[0].Metrics {
		if mm.Name != otelobserver.MetricEndpointEvents {
			continue
		}
		found = true
		sum := mm.Data.(metricdata.Sum[int64])
		require.Len(t, sum.DataPoints, 1)
		assert.Equal(t, int64(2), sum.DataPoints[0].Value)
		kind, _ := sum.DataPoints[0].Attributes.Value(otelobserver.AttrEndpointEvent)
		assert.Equal(t, string(kvroute.EndpointEjected), kind.AsString())
	}
	assert.True(t, found)
}

func TestNewErrors(t *testing.T) {
	for name, opt := range map[string]otelobserver.Option{
		"WithTracerProvider": otelobserver.WithTracerProvider(nil),
		"WithMeterProvider":  otelobserver.WithMeterProvider(nil),
		"WithPropagator":     otelobserver.WithPropagator(nil),
	} {
		_, err := otelobserver.New(opt)
		require.ErrorIs(t, err, otelobserver.ErrInvalidConfig, name)
		assert.Contains(t, err.Error(), name)
	}
}

// A turn's http.route is the path of one of kvroute's APIs, or "other":
// paths clients choose add no attribute set.
func TestRouteBounded(t *testing.T) {
	reader := sdkmetric.NewManualReader()
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(reader))
	defer func() { _ = mp.Shutdown(context.Background()) }()
	o, err := otelobserver.New(otelobserver.WithMeterProvider(mp))
	require.NoError(t, err)
	for i := range 100 {
		o.ObserveTurn(&kvroute.TurnRecord{Path: "/v1/chat/completions/" + strconv.Itoa(i), Reuse: kvroute.ReuseMiss})
	}
	o.ObserveTurn(&kvroute.TurnRecord{Path: kvroute.PathMessages, Reuse: kvroute.ReuseMiss})
	var rm metricdata.ResourceMetrics
	require.NoError(t, reader.Collect(context.Background(), &rm))
	routes := map[string]int64{}
	for _, mm := range rm.ScopeMetrics[0].Metrics {
		if mm.Name != otelobserver.MetricTurns {
			continue
		}
		for _, dp := range mm.Data.(metricdata.Sum[int64]).DataPoints {
			r, _ := dp.Attributes.Value(otelobserver.AttrRoute)
			routes[r.AsString()] += dp.Value
		}
	}
	assert.Equal(t, map[string]int64{"other": 100, kvroute.PathMessages: 1}, routes)
}
