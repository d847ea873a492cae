package otelobserver

import (
	"context"
	"errors"
	"net/http"
	"net/url"
	"strconv"
	"sync"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/propagation"
	semconv "go.opentelemetry.io/otel/semconv/v1.43.0"
	"go.opentelemetry.io/otel/trace"

	"github.com/bidikv/bidikv/kvroute"
)

// StartTurn starts the turn's span: a child of the span in ctx or, when
// ctx holds no local span, of the trace context in the client's headers.
// It implements kvroute.Tracer.
func (o *Observer) StartTurn(ctx context.Context, req *kvroute.Request) (context.Context, func(*kvroute.TurnRecord)) {
	kind := trace.SpanKindInternal
	if sc := trace.SpanContextFromContext(ctx); !sc.IsValid() || sc.IsRemote() {
		ctx = o.prop.Extract(ctx, propagation.HeaderCarrier(req.Header))
		kind = trace.SpanKindServer
	}
	ctx, span := o.tracer.Start(ctx, SpanTurn, trace.WithSpanKind(kind),
		trace.WithAttributes(AttrRoute.String(req.Path)))
	return ctx, func(rec *kvroute.TurnRecord) { o.endTurn(span, rec) }
}

// StartPhase starts a phase's span within ctx. It implements
// kvroute.Tracer.
func (o *Observer) StartPhase(ctx context.Context, phase kvroute.Phase, endpoint string) (context.Context, func(error)) {
	ctx, span := o.tracer.Start(ctx, spanName(phase), o.starts.get(phase, endpoint)...)
	return ctx, func(err error) {
		setError(span, err, true)
		span.End()
	}
}

// Inject replaces the propagator's headers in h (an engine request's) with
// the trace context of ctx. It implements kvroute.Tracer.
func (o *Observer) Inject(ctx context.Context, h http.Header) {
	for _, f := range o.fields {
		h.Del(f)
	}
	o.prop.Inject(ctx, propagation.HeaderCarrier(h))
}

// maxCachedStarts bounds the phase spans' cached start options: one per
// phase and endpoint, so a fleet whose endpoints keep changing does not
// grow the cache without end (past the bound, options are built per span).
const maxCachedStarts = 4096

// phaseStarts caches the start options of phase spans by phase and
// endpoint: the kind and the attributes that name the engine.
type phaseStarts struct {
	mu sync.RWMutex
	m  map[phaseKey][]trace.SpanStartOption
}

type phaseKey struct {
	phase    kvroute.Phase
	endpoint string
}

func (c *phaseStarts) get(phase kvroute.Phase, endpoint string) []trace.SpanStartOption {
	k := phaseKey{phase, endpoint}
	c.mu.RLock()
	opts, ok := c.m[k]
	c.mu.RUnlock()
	if ok {
		return opts
	}
	opts = phaseStartOptions(phase, endpoint)
	c.mu.Lock()
	if c.m == nil {
		c.m = map[phaseKey][]trace.SpanStartOption{}
	}
	if len(c.m) < maxCachedStarts {
		c.m[k] = opts
	}
	c.mu.Unlock()
	return opts
}

func phaseStartOptions(phase kvroute.Phase, endpoint string) []trace.SpanStartOption {
	kind := trace.SpanKindClient
	if phase == kvroute.PhaseLookup || phase == kvroute.PhaseStream {
		kind = trace.SpanKindInternal
	}
	attrs := []attribute.KeyValue{AttrPhase.String(string(phase))}
	if endpoint != "" {
		attrs = append(attrs, AttrEndpoint.String(endpoint))
		if u, err := url.Parse(endpoint); err == nil && u.Hostname() != "" {
			attrs = append(attrs, semconv.ServerAddress(u.Hostname()))
			if p, err := strconv.Atoi(u.Port()); err == nil {
				attrs = append(attrs, semconv.ServerPort(p))
			}
		}
	}
	return []trace.SpanStartOption{trace.WithSpanKind(kind), trace.WithAttributes(attrs...)}
}

func spanName(p kvroute.Phase) string {
	switch p {
	case kvroute.PhaseLookup:
		return SpanLookup
	case kvroute.PhaseVerify:
		return SpanVerify
	case kvroute.PhasePrefill:
		return SpanPrefill
	case kvroute.PhaseDecode:
		return SpanDecode
	case kvroute.PhaseStream:
		return SpanStream
	}
	return "bidikv." + string(p)
}

// setError marks span failed with err, with the engine's status for a
// phase; a cancellation by the caller is marked as such and is no error of
// the span.
func setError(span trace.Span, err error, phase bool) {
	if err == nil {
		return
	}
	if errors.Is(err, context.Canceled) {
		span.SetAttributes(AttrCanceled.Bool(true))
		return
	}
	var ue *kvroute.UpstreamError
	if phase && errors.As(err, &ue) && ue.Status != 0 {
		span.SetAttributes(semconv.HTTPResponseStatusCode(ue.Status))
	}
	// kvroute's errors hold no request content (UpstreamError names the
	// phase, the engine and the status).
	span.RecordError(err)
	span.SetStatus(codes.Error, err.Error())
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// endTurn sets the record's attributes on the turn's span and ends it.
func (o *Observer) endTurn(span trace.Span, rec *kvroute.TurnRecord) {
	if !span.IsRecording() {
		span.End()
		return
	}
	attrs := make([]attribute.KeyValue, 0, 24)
	attrs = append(attrs,
		AttrRequestID.String(rec.RequestID),
		AttrStream.Bool(rec.Stream),
		AttrReuse.String(string(rec.Reuse)),
		AttrReusableTokens.Int(rec.ReusableTokens),
		AttrStored.Bool(rec.Stored),
		AttrBytes.Int64(rec.Bytes),
	)
	if rec.MissReason != "" {
		attrs = append(attrs, AttrMissReason.String(string(rec.MissReason)))
	}
	if rec.Released {
		attrs = append(attrs, AttrReleased.Bool(true))
	}
	if rec.Verification != "" {
		attrs = append(attrs, AttrVerification.String(string(rec.Verification)))
	}
	if rec.Verification == kvroute.VerifyTokens {
		attrs = append(attrs, AttrVerifiedTokens.Int(rec.VerifiedTokens))
	}
	if rec.HandleTokens > 0 {
		attrs = append(attrs, AttrHandleTokens.Int(rec.HandleTokens))
	}
	if rec.PromptTokens > 0 {
		attrs = append(attrs, AttrPromptTokens.Int(rec.PromptTokens))
	}
	if rec.CachedTokens >= 0 {
		attrs = append(attrs, AttrCachedTokens.Int(rec.CachedTokens))
	}
	if rec.TokenSource != "" {
		attrs = append(attrs, AttrTokenSource.String(string(rec.TokenSource)))
	}
	if rec.Partial {
		attrs = append(attrs, AttrPartial.Bool(true))
	}
	if rec.Unconfirmed {
		attrs = append(attrs, AttrUnconfirmed.Bool(true))
	}
	if rec.Reuse == kvroute.ReuseHit {
		attrs = append(attrs, AttrHandleAgeMS.Float64(ms(rec.HandleAge)))
	}
	if rec.PrefillEndpoint != "" {
		attrs = append(attrs, AttrPrefillURL.String(rec.PrefillEndpoint), AttrAttempts.Int(rec.PrefillAttempts))
	}
	if rec.DecodeEndpoint != "" {
		attrs = append(attrs, AttrDecodeURL.String(rec.DecodeEndpoint), AttrFirstByteMS.Float64(ms(rec.FirstByte)))
	}
	if rec.TTFT > 0 {
		attrs = append(attrs, AttrTTFTMS.Float64(ms(rec.TTFT)))
	}
	if rec.LocalFallback {
		attrs = append(attrs, AttrLocalFallback.Bool(true))
	}
	if rec.NoHandle != "" {
		attrs = append(attrs, AttrNoHandle.String(string(rec.NoHandle)))
	}
	if rec.StoreRefusal != "" {
		attrs = append(attrs, AttrStoreRefusal.String(string(rec.StoreRefusal)))
	}
	if rec.Err != nil {
		attrs = append(attrs, AttrErrorPhase.String(string(rec.ErrPhase)))
	}
	attrs = o.turnFields.attrs(attrs, rec)
	span.SetAttributes(attrs...)
	setError(span, rec.Err, false)
	span.End()
}
