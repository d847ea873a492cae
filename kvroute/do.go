package kvroute

import (
	"context"
	"log/slog"
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
//	read → lookup → verify → choose the path → release → prefill → decode (→ retain)
func (r *Router) Do(ctx context.Context, req *Request) (*Response, error) {
	t := r.begin(req)
	ctx = t.trace.start(ctx, req)
	t.values = context.WithoutCancel(ctx)
	if r.closed.Load() {
		return nil, t.fail(PhaseLookup, ErrClosed)
	}
	if err := read(ctx, t); err != nil { // read.go
		return nil, t.fail(PhaseLookup, err)
	}
	if t.req.api.kind == passThrough {
		return forward(ctx, t) // api.go: one leg to a decode engine, nothing retained
	}
	lctx, endLookup := t.trace.phase(ctx, PhaseLookup, "")
	f := lookup(lctx, t)                      // lookup.go: the handle the request continues, taken from the Store
	h := verify(lctx, t, &f)                  // verify.go: attached (cut to its verified prefix), or put back
	w := choosePath(lctx, t, &f, h)           // path.go: pull, decode-local or recompute
	w.rel, w.relWhy = release(lctx, t, &f, w) // release.go: a handle not attached, released or put back
	endLookup(nil)
	tr := tries{badP: f.avoid}
	in := retainIn{cands: f.cands, turn: f.turn}
	if w.local != nil {
		in.decodeLocal = true
		resp, err := decodeLocal(ctx, t, w.local, &tr, in) // decode.go
		if err == nil {
			return resp, nil
		}
		if !tr.redo(ctx, t, err) {
			return nil, t.fail(PhaseDecode, err)
		}
		// The decode engine failed before any byte reached the caller,
		// and the retained handle is still in the store: a plain miss.
		localFailed(ctx, t, w.local, err)
		in.decodeLocal = false
	}
	for {
		p, err := prefill(ctx, t, &f, w, &tr) // prefill.go
		if err != nil {
			return nil, t.fail(PhasePrefill, err)
		}
		affinity := ""
		if p.hit {
			affinity = f.e.Endpoint
		}
		in.noPrefill = tr.local
		resp, err := decode(ctx, t, p, affinity, &tr, in) // decode.go; the Response retains (retain.go)
		if err == nil {
			return resp, nil
		}
		if !tr.redo(ctx, t, err) {
			return nil, t.fail(PhaseDecode, err)
		}
		// Nothing reached the caller and P's handle may be spent or
		// stale: run the whole turn again as a plain miss, preferring
		// another prefill engine.
		if w.h.handle != nil {
			r.stats.hitRetries.Add(1)
			t.miss(MissRetry)
		}
		w.h, w.rel = hit{}, nil
		tr.avoidP = append(tr.avoidP, p.url)
	}
}

// localFailed turns a failed decode-local leg into a plain miss.
func localFailed(ctx context.Context, t *turn, ep *endpoint, err error) {
	t.r.stats.localFailures.Add(1)
	t.r.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: decode-local leg failed; running the turn as a plain prefill",
		slog.String("request_id", t.id), slog.String("engine_request_id", t.legs.id), slog.String("endpoint", ep.url), slog.String("err", err.Error()))
	t.chose = false
	t.miss(MissRetry)
}
