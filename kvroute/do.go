package kvroute

import (
	"context"
	"errors"
	"log/slog"

	"github.com/bidikv/bidikv/threshold"
)

// Do runs one turn: look up a retained handle, prefill on a prefill engine,
// decode on a decode engine, and return the decode engine's response with
// every kv_transfer_params removed. The handle D returns is retained when
// the turn ends: at once for a non-streaming response, when the stream's
// last event has been read for a streaming one.
//
// The caller must Close the Response. An error before any response maps to
// an HTTP status with HTTPStatus. Do does not modify req.Body. The context
// governs both legs and the whole stream: cancelling it aborts the decode
// request on the engine.
//
// The turn is a sequence of phases, each in its own file, each handing the
// next its result (ARCHITECTURE.md draws it):
//
//	read → lookup → verify → choose the path → release → prefill → decode → retain → end
//
// Do owns the turn's retainer (retain.go): it hands it to the Response,
// which reports D's whole answer to it (kept: the retain phase) and ends
// the turn through it (end); Do's own failures end the turn there too.
func (r *Router) Do(ctx context.Context, req *Request) (*Response, error) {
	t := r.begin(req)
	rt := &retainer{t: t}
	ctx = t.trace.start(ctx, req)
	t.values = context.WithoutCancel(ctx)
	if r.closed.Load() {
		return nil, rt.end(PhaseLookup, ErrClosed)
	}
	if err := read(ctx, t); err != nil { // read.go
		return nil, rt.end(PhaseLookup, err)
	}
	if t.req.api.kind == passThrough {
		return forward(ctx, rt) // api.go: one leg to a decode engine, nothing retained
	}
	lctx, endLookup := t.trace.phase(ctx, PhaseLookup, "")
	f := lookup(lctx, t)                      // lookup.go: the handle the request continues, taken from the Store
	h := verify(lctx, t, &f)                  // verify.go: attached (cut to its verified prefix), or put back
	w := choosePath(t, &f, h)                 // path.go: pull, decode-local or recompute
	w.rel, w.relWhy = release(lctx, t, &f, w) // release.go: a handle not attached, released or put back
	endLookup(nil)
	rt.tries, rt.cands, rt.conv, rt.chose = tries{badP: f.avoid}, f.cands, f.turn, w.chose
	if w.local != nil {
		rt.decodeLocal = true
		resp, err := decodeLocal(ctx, t, w, &rt.tries) // decode.go
		if err == nil {
			return resp.to(rt), nil // response.go: the Response reports to rt, which retains (retain.go)
		}
		if !rt.redo(ctx, t, err) {
			return nil, rt.end(PhaseDecode, err)
		}
		// The decode engine failed before any byte reached the caller,
		// and the retained handle is still in the store: a plain miss.
		localFailed(ctx, rt, w.local, err)
		w.local = nil
	}
	for {
		p, err := prefill(ctx, t, &f, w, &rt.tries) // prefill.go
		if err != nil {
			return nil, rt.end(PhasePrefill, err)
		}
		rt.prefilled(p)
		affinity := ""
		if p.hit {
			affinity = f.e.Endpoint
		}
		resp, err := decode(ctx, t, p, affinity, &rt.tries) // decode.go
		if err == nil {
			return resp.to(rt), nil // response.go: the Response reports to rt, which retains (retain.go)
		}
		if !rt.redo(ctx, t, err) {
			return nil, rt.end(PhaseDecode, err)
		}
		// Nothing reached the caller and P's handle may be spent or
		// stale: run the whole turn again as a plain miss, preferring
		// another prefill engine.
		if w.h.handle != nil {
			r.stats.hitRetries.Add(1)
			t.miss(MissRetry)
		}
		w.h, w.rel, w.prompt = hit{}, nil, p.prompt
		rt.avoidP = append(rt.avoidP, p.url)
	}
}

// localFailed turns a failed decode-local leg into a plain miss: the
// learning Chooser observes nothing of the turn.
func localFailed(ctx context.Context, rt *retainer, ep *endpoint, err error) {
	t := rt.t
	t.r.stats.localFailures.Add(1)
	t.r.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: decode-local leg failed; running the turn as a plain prefill",
		slog.String("request_id", t.id), slog.String("engine_request_id", t.legs.id), slog.String("endpoint", ep.url), slog.String("err", err.Error()))
	rt.chose.asked = false
	rt.decodeLocal = false
	t.miss(MissRetry)
}

// prefilled takes what the retain phase and the learning Chooser need of
// the prefill phase's result.
func (rt *retainer) prefilled(p prefilled) {
	if p.endpoint != "" {
		rt.prefill = p.endpoint
	}
	rt.took = p.took
}

// end ends the turn, once, and returns err: what ended it, nil for a whole
// answer, in phase. A stream its caller closed ends with context.Canceled
// (PhaseStream), which is no failure. It releases the Chooser's
// reservation and every pooled buffer the turn still holds, reports the
// turn's engine times to a learning Chooser, and hands the record to the
// Observer and the trace.
func (rt *retainer) end(phase Phase, err error) error {
	t := rt.t
	t.rec.calls.end++
	if rt.ended {
		return err
	}
	rt.ended = true
	if err != nil {
		if phase == PhaseStream && rt.refusal == "" {
			rt.refused(RefuseStreamError)
		}
		if phase != PhaseStream || !errors.Is(err, context.Canceled) {
			rt.failed = true
			t.rec.Err, t.rec.ErrPhase = err, phase
			t.r.stats.failures.Add(1)
		}
	}
	t.trace.endPhases(err)
	t.rec.Total = t.since()
	rt.chose.Release()
	if t.sampling != "" {
		t.r.learned.unsample(t.sampling, t.req.Path)
	}
	if e, ok := t.proof.(interface{ end() }); ok {
		e.end()
	}
	rt.observe()
	if o := t.r.cfg.observer; o != nil {
		o.ObserveTurn(&t.rec)
	}
	t.trace.finish(&t.rec)
	if t.bufs.release() {
		t.r.stats.renderedPromptIDs.Add(1)
	}
	return err
}

// observe reports the finished turn's engine times to a learning Chooser:
// streaming turns only, whose first event is the first token (a
// non-streaming answer, or a buffered stream's, arrives whole, after the
// last one).
func (rt *retainer) observe() {
	t, o := rt.t, rt.resp
	l := t.r.learner
	if l == nil || !rt.chose.asked || !t.stream || o == nil || o.buf != nil || rt.failed || o.ttft <= 0 || o.sent.IsZero() {
		return
	}
	first := o.ttft - o.sent.Sub(t.start)
	if first <= 0 {
		return
	}
	ob := threshold.Observation{Path: rt.chose.Path, Decode: o.ep.url,
		PromptTokens: rt.chose.prompt, ReusableTokens: rt.chose.matched, DecodeFirst: first}
	if ob.Path != threshold.PathLocal {
		ob.Prefill = rt.took
	}
	l.Observe(ob)
}
