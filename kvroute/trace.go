package kvroute

import (
	"context"
	"net/http"
)

// Tracer follows a turn while it runs, for distributed tracing: one span
// per turn, one per phase, and the trace context on every engine request,
// so that engines that trace (vLLM with --otlp-traces-endpoint) join the
// turn's trace. The module kvroute/otelobserver implements it with
// OpenTelemetry; kvroute itself depends on no tracing library. It is a
// public seam (ARCHITECTURE.md, Seams), given with WithTracer.
//
// The router calls a Tracer on the goroutines that run the turn (Do's, then
// the one reading a stream), never concurrently for one turn. Every
// function it returns is called exactly once. A Tracer must not block.
type Tracer interface {
	// StartTurn is called when Do starts, before the request is validated.
	// ctx is Do's context and req the client's request (req.Header holds
	// the client's headers, where an inbound trace context is found). It
	// returns the context the turn runs in and the function called when
	// the turn ends, with the same record the Observer gets (after the
	// Observer); end must not keep rec.
	StartTurn(ctx context.Context, req *Request) (context.Context, func(rec *TurnRecord))
	// StartPhase is called when a phase starts: PhaseLookup within the
	// turn's context; PhaseVerify once per render or tokenize call, within
	// the lookup's; PhasePrefill once per prefill attempt and PhaseDecode once
	// per decode leg, within the turn's; PhaseStream, once the stream's
	// first event was read, within its decode leg's. endpoint is the
	// engine's base URL ("" for PhaseLookup). It returns the phase's
	// context, from which the phase's engine requests are built, and the
	// function called when the phase ends, with the phase's error (nil on
	// success). A decode leg that streams ends with its stream.
	StartPhase(ctx context.Context, phase Phase, endpoint string) (context.Context, func(err error))
	// Inject writes the trace context of ctx, a phase's context, into h,
	// the headers of an engine request, replacing any trace context the
	// client sent (which the router otherwise forwards as it forwards
	// every end-to-end header).
	Inject(ctx context.Context, h http.Header)
}

// turnTrace is a turn's tracing state: the turn's span, and the decode
// leg's phases that stay open while its stream is read.
type turnTrace struct {
	tr                   Tracer            // WithTracer; nil: nothing is traced
	end                  func(*TurnRecord) // ends the turn's span
	endDecode, endStream func(error)       // the open decode leg's phases
}

// noEnd ends a phase when no Tracer is set.
func noEnd(error) {}

// start starts the turn's trace and returns the context it runs in.
func (t *turnTrace) start(ctx context.Context, req *Request) context.Context {
	if t.tr == nil {
		return ctx
	}
	ctx, t.end = t.tr.StartTurn(ctx, req)
	return ctx
}

// finish ends the turn's trace with its record, after any phase still
// open (a body is read, and the turn ends, within its decode leg).
func (t *turnTrace) finish(rec *TurnRecord) {
	t.endPhases(nil)
	if end := t.end; end != nil {
		t.end = nil
		end(rec)
	}
}

// phase starts a phase within ctx.
func (t *turnTrace) phase(ctx context.Context, phase Phase, endpoint string) (context.Context, func(error)) {
	if t.tr == nil {
		return ctx, noEnd
	}
	return t.tr.StartPhase(ctx, phase, endpoint)
}

// startDecode starts a decode leg's phase, which decodeDone, endPhases or
// finish ends.
func (t *turnTrace) startDecode(ctx context.Context, endpoint string) context.Context {
	if t.tr == nil {
		return ctx
	}
	ctx, t.endDecode = t.tr.StartPhase(ctx, PhaseDecode, endpoint)
	return ctx
}

// decodeDone ends a decode leg's phase with err, or for a stream (err nil,
// stream set) keeps it open and starts PhaseStream within it: both end
// with the stream (endPhases).
func (t *turnTrace) decodeDone(ctx context.Context, stream bool, endpoint string, err error) {
	if t.endDecode == nil {
		return // no Tracer, or the turn has ended
	}
	if err == nil && stream {
		_, t.endStream = t.tr.StartPhase(ctx, PhaseStream, endpoint)
		return
	}
	t.endPhases(err)
}

// endPhases ends the open stream and decode phases with err.
func (t *turnTrace) endPhases(err error) {
	if end := t.endStream; end != nil {
		t.endStream = nil
		end(err)
	}
	if end := t.endDecode; end != nil {
		t.endDecode = nil
		end(err)
	}
}

// inject writes the phase's trace context into an engine request's headers.
func (t *turnTrace) inject(ctx context.Context, h http.Header) {
	if t.tr != nil {
		t.tr.Inject(ctx, h)
	}
}
