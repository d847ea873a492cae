package otelobserver

import (
	"context"
	"errors"
	"slices"
	"sync"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/metric"

	"github.com/bidikv/bidikv/kvroute"
)

// Metric names.
const (
	MetricTurns           = "bidikv.turns"
	MetricTTFT            = "bidikv.ttft"
	MetricTurnDuration    = "bidikv.turn.duration"
	MetricPrefillDuration = "bidikv.prefill.duration"
	MetricFirstByte       = "bidikv.decode.first_byte"
	MetricReuseTokens     = "bidikv.reuse.tokens"
	MetricPrefillAttempts = "bidikv.prefill.attempts"
	MetricResponseSize    = "bidikv.response.size"
	MetricEndpointEvents  = "bidikv.endpoint.events"
)

// secondBuckets are the boundaries of the duration histograms, in seconds:
// from a few milliseconds (a hit's TTFT on a small model) to a minute (a
// long prefill under load).
var secondBuckets = []float64{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60}

// tokenBuckets are the boundaries of the reusable-token histogram.
var tokenBuckets = []float64{16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576}

type instruments struct {
	turns, endpoints                 metric.Int64Counter
	ttft, duration, prefill, firstB  metric.Float64Histogram
	reuseTokens, attempts, respBytes metric.Int64Histogram
	sets                             turnSets
}

// turnKey is what a turn's metric attributes depend on.
type turnKey struct {
	path  string
	reuse kvroute.ReuseOutcome
	miss  kvroute.MissReason
	phase kvroute.Phase // the failed phase, "" on success
}

// turnAttrs are a turn's measurement options: all its attributes (turns),
// the route and reuse outcome (the histograms), the route alone.
type turnAttrs struct {
	turn, reuse, route metric.MeasurementOption
}

// maxCachedSets bounds turnSets; the keys are few (routes, outcomes, miss
// reasons and phases are constants).
const maxCachedSets = 1024

// turnSets caches turnAttrs by turnKey.
type turnSets struct {
	mu sync.RWMutex
	m  map[turnKey]turnAttrs
}

func (c *turnSets) get(k turnKey) turnAttrs {
	c.mu.RLock()
	a, ok := c.m[k]
	c.mu.RUnlock()
	if ok {
		return a
	}
	route, reuse := AttrRoute.String(k.path), AttrReuse.String(string(k.reuse))
	all := []attribute.KeyValue{route, reuse}
	if k.miss != "" {
		all = append(all, AttrMissReason.String(string(k.miss)))
	}
	if k.phase != "" {
		all = append(all, AttrErrorPhase.String(string(k.phase)))
	}
	a = turnAttrs{
		turn:  metric.WithAttributeSet(attribute.NewSet(all...)),
		reuse: metric.WithAttributeSet(attribute.NewSet(route, reuse)),
		route: metric.WithAttributeSet(attribute.NewSet(route)),
	}
	c.mu.Lock()
	if c.m == nil {
		c.m = map[turnKey]turnAttrs{}
	}
	if len(c.m) < maxCachedSets {
		c.m[k] = a
	}
	c.mu.Unlock()
	return a
}

func (m *instruments) init(meter metric.Meter) error {
	var errs [9]error
	m.turns, errs[0] = meter.Int64Counter(MetricTurns, metric.WithUnit("{turn}"),
		metric.WithDescription("Turns by reuse outcome (bidikv.reuse), miss reason and failed phase."))
	m.ttft, errs[1] = meter.Float64Histogram(MetricTTFT, metric.WithUnit("s"),
		metric.WithDescription("Time from the start of a turn to the first event or body handed to the caller."),
		metric.WithExplicitBucketBoundaries(secondBuckets...))
	m.duration, errs[2] = meter.Float64Histogram(MetricTurnDuration, metric.WithUnit("s"),
		metric.WithDescription("Time from the start of a turn to its end."),
		metric.WithExplicitBucketBoundaries(secondBuckets...))
	m.prefill, errs[3] = meter.Float64Histogram(MetricPrefillDuration, metric.WithUnit("s"),
		metric.WithDescription("The prefill leg, request to the prefill engine's answer, retries included."),
		metric.WithExplicitBucketBoundaries(secondBuckets...))
	m.firstB, errs[4] = meter.Float64Histogram(MetricFirstByte, metric.WithUnit("s"),
		metric.WithDescription("Decode request to the decode engine's response headers."),
		metric.WithExplicitBucketBoundaries(secondBuckets...))
	m.reuseTokens, errs[5] = meter.Int64Histogram(MetricReuseTokens, metric.WithUnit("{token}"),
		metric.WithDescription("Tokens the attached handle let the prefill engine read, per hit."),
		metric.WithExplicitBucketBoundaries(tokenBuckets...))
	m.attempts, errs[6] = meter.Int64Histogram(MetricPrefillAttempts, metric.WithUnit("{attempt}"),
		metric.WithDescription("Prefill attempts per turn."),
		metric.WithExplicitBucketBoundaries(1, 2, 3, 4, 5, 8))
	m.respBytes, errs[7] = meter.Int64Histogram(MetricResponseSize, metric.WithUnit("By"),
		metric.WithDescription("Response bytes handed to the caller per turn."))
	m.endpoints, errs[8] = meter.Int64Counter(MetricEndpointEvents, metric.WithUnit("{event}"),
		metric.WithDescription("Endpoint ejections, re-admissions, additions and removals."))
	return errors.Join(errs[:]...)
}

// ObserveTurn records the turn's metrics. It implements kvroute.Observer.
func (o *Observer) ObserveTurn(rec *kvroute.TurnRecord) {
	ctx := context.Background()
	m := &o.m
	k := turnKey{path: routeOf(rec.Path), reuse: rec.Reuse, miss: rec.MissReason}
	if rec.Err != nil {
		k.phase = rec.ErrPhase
	}
	a := m.sets.get(k)
	m.turns.Add(ctx, 1, a.turn)
	reuse := a.reuse
	m.duration.Record(ctx, rec.Total.Seconds(), reuse)
	if rec.PrefillAttempts > 0 {
		m.attempts.Record(ctx, int64(rec.PrefillAttempts), reuse)
	}
	if rec.Err != nil {
		return
	}
	if rec.TTFT > 0 {
		m.ttft.Record(ctx, rec.TTFT.Seconds(), reuse)
	}
	if rec.Prefill > 0 {
		m.prefill.Record(ctx, rec.Prefill.Seconds(), reuse)
	}
	if rec.FirstByte > 0 {
		m.firstB.Record(ctx, rec.FirstByte.Seconds(), reuse)
	}
	if rec.Reuse == kvroute.ReuseHit {
		m.reuseTokens.Record(ctx, int64(rec.ReusableTokens), a.route)
	}
	m.respBytes.Record(ctx, rec.Bytes, reuse)
}

// routes are the paths of kvroute's APIs.
var routes = func() []string {
	var out []string
	for _, a := range kvroute.APIs() {
		out = append(out, a.Path)
	}
	return out
}()

// routeOf is the http.route of a turn whose request path is path: path
// when it is one of kvroute's APIs, else "other". The path is the
// client's (ServeHTTP serves whatever path it is mounted on), so that it
// cannot grow the metrics' attribute sets without bound.
func routeOf(path string) string {
	if slices.Contains(routes, path) {
		return path
	}
	return "other"
}

// ObserveEndpoint counts endpoint events by phase and kind. It implements
// kvroute.EndpointObserver.
func (o *Observer) ObserveEndpoint(ev kvroute.EndpointEvent) {
	o.m.endpoints.Add(context.Background(), 1,
		metric.WithAttributes(AttrPhase.String(string(ev.Phase)), AttrEndpointEvent.String(string(ev.Kind))))
}
