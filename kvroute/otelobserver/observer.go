package otelobserver

import (
	"errors"
	"fmt"

	"go.opentelemetry.io/otel/metric"
	metricnoop "go.opentelemetry.io/otel/metric/noop"
	"go.opentelemetry.io/otel/propagation"
	"go.opentelemetry.io/otel/trace"
	tracenoop "go.opentelemetry.io/otel/trace/noop"

	"github.com/bidikv/bidikv/kvroute"
)

// ScopeName is the instrumentation scope of the tracer and the meter.
const ScopeName = "github.com/bidikv/bidikv/kvroute/otelobserver"

// ErrInvalidConfig is wrapped by every error New returns for a bad option.
var ErrInvalidConfig = errors.New("otelobserver: invalid configuration")

// Observer traces kvroute turns (as a kvroute.Tracer) and records their
// metrics (as a kvroute.Observer and kvroute.EndpointObserver). It is safe
// for concurrent use.
type Observer struct {
	tracer trace.Tracer
	prop   propagation.TextMapPropagator
	fields []string // the propagator's headers, replaced on every engine request
	m      instruments
	starts phaseStarts

	turnFields recordFields // the record's fields without an Attr of their own
}

var (
	_ kvroute.Tracer           = (*Observer)(nil)
	_ kvroute.Observer         = (*Observer)(nil)
	_ kvroute.EndpointObserver = (*Observer)(nil)
)

// Option configures an Observer.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	tp   trace.TracerProvider
	mp   metric.MeterProvider
	prop propagation.TextMapPropagator
	errs []error
}

func (c *config) fail(option, msg string) {
	c.errs = append(c.errs, fmt.Errorf("%w: %s: %s", ErrInvalidConfig, option, msg))
}

// WithTracerProvider sets where spans go. The default records no span
// (a no-op provider), but still propagates an inbound trace context to the
// engines.
func WithTracerProvider(tp trace.TracerProvider) Option {
	return optionFunc(func(c *config) {
		if tp == nil {
			c.fail("WithTracerProvider", "provider is nil")
			return
		}
		c.tp = tp
	})
}

// WithMeterProvider sets where metrics go. The default records none (a
// no-op provider).
func WithMeterProvider(mp metric.MeterProvider) Option {
	return optionFunc(func(c *config) {
		if mp == nil {
			c.fail("WithMeterProvider", "provider is nil")
			return
		}
		c.mp = mp
	})
}

// WithPropagator sets how trace context is read from the client's headers
// and written to the engines'. The default is W3C Trace Context
// (traceparent and tracestate), which vLLM reads; a composite with
// propagation.Baggage{} also carries baggage.
func WithPropagator(p propagation.TextMapPropagator) Option {
	return optionFunc(func(c *config) {
		if p == nil {
			c.fail("WithPropagator", "propagator is nil")
			return
		}
		c.prop = p
	})
}

// New returns an Observer configured by opts. It fails, wrapping
// ErrInvalidConfig, on a nil provider or propagator, and when the meter
// refuses an instrument.
func New(opts ...Option) (*Observer, error) {
	c := config{tp: tracenoop.NewTracerProvider(), mp: metricnoop.NewMeterProvider(), prop: propagation.TraceContext{}}
	for _, o := range opts {
		o.apply(&c)
	}
	if len(c.errs) > 0 {
		return nil, errors.Join(c.errs...)
	}
	o := &Observer{
		tracer: c.tp.Tracer(ScopeName),
		prop:   c.prop,
		fields: c.prop.Fields(),
	}
	var err error
	if o.turnFields, err = newRecordFields(); err != nil {
		return nil, err // kvroute's own tags: TestRecordFieldsOnSpan fails first
	}
	if err := o.m.init(c.mp.Meter(ScopeName)); err != nil {
		return nil, fmt.Errorf("%w: WithMeterProvider: %v", ErrInvalidConfig, err)
	}
	return o, nil
}

// Options returns the kvroute options that install o: WithTracer(o) and
// WithObserver(o). A service with an Observer of its own calls
// o.ObserveTurn from it instead of using WithObserver(o).
func (o *Observer) Options() []kvroute.Option {
	return []kvroute.Option{kvroute.WithTracer(o), kvroute.WithObserver(o)}
}
