package kvroute

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"log/slog"
	"net/http"
	"time"

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
	if err := read(ctx, t); err != nil { // request.go
		return nil, rt.end(PhaseLookup, err)
	}
	if t.req.api.kind == passThrough {
		return forward(ctx, rt) // api.go: one leg to a decode engine, nothing retained
	}
	lctx, endLookup := t.trace.phase(ctx, PhaseLookup, "")
	f := lookup(lctx, t)                      // lookup.go: the handle the request continues, taken from the Store
	placedOf(t, &f)                           // lookup.go: what the last decode engine's CPU tier holds of it
	h := verify(lctx, t, &f)                  // verify.go: attached (cut to its verified prefix), or put back
	w := choosePath(t, &f, h)                 // lookup.go: pull, decode-local or recompute
	w.rel, w.relWhy = release(lctx, t, &f, w) // lookup.go: a handle not attached, released or put back
	w = peerPath(lctx, t, &f, w)              // lookup.go: a prefill leg without a GPU hold pulls from it
	endLookup(nil)
	rt.tries, rt.cands, rt.conv, rt.chose = tries{badP: f.avoid}, f.cands, f.turn, w.chose
	rt.placed, rt.placedKey = f.placed, f.placedKey
	if w.local != nil {
		rt.decodeLocal, rt.prompt = true, max(rt.prompt, w.prompt)
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
		switch {
		case p.hit:
			affinity = f.e.Endpoint
		case w.peer.decode != "":
			// the engine whose tier the history came from: its prefix
			// cache likely still holds it, so it reads only the rest
			affinity = w.peer.decode
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
	if p.prompt > 0 {
		rt.prompt = p.prompt
	}
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

// turn is what the phases of one Do call share: the request, the ids the
// client and the engines see, the record they report into (which only
// the turn's end reads: the observer path), the trace, how engine
// requests are built, the pooled buffers the turn owns and its
// verification. Phases hand each other results (found, hit, way, ...),
// never fields of the turn; the retainer Do owns ends it once (do.go).
type turn struct {
	r      *Router
	req    *Request
	id     string // the request id the client sees: its own, or a generated one
	start  time.Time
	stream bool // the client streams
	rec    TurnRecord
	legs   legs
	trace  turnTrace
	bufs   turnBufs
	proof  proof // the turn's verification (verify.go)
	// sampling is the decode engine whose streams of the API this turn's
	// stream shows (buffered.go), released when the turn ends.
	sampling string
	// roomMade: a decode leg of the turn had room made on its engine
	// (memory.go, arrive): its other legs make none.
	roomMade bool
	// values is Do's context without its cancellation: the Store calls
	// that retain the turn's handle carry its values (a trace, a
	// caller's marks) but are not lost when the client goes, and may run
	// after the turn (a render answered late).
	values context.Context
}

// begin starts a turn for req: its ids, its record, its buffers and its
// verification. A client's X-Request-Id is echoed and, made unique, sent to
// the engines; absent or invalid, the router generates one.
func (r *Router) begin(req *Request) *turn {
	t := &turn{r: r, req: req, start: r.cfg.clock(), values: context.Background()}
	if req.Header == nil {
		req.Header = http.Header{}
	}
	t.id = req.Header.Get(headerRequestID)
	legID := t.id
	switch {
	case !validRequestID(t.id):
		// Absent, too long or not visible ASCII: never echoed, forwarded
		// or logged.
		t.id = newRequestID()
		legID = t.id
	default:
		// The client's id, made unique for the engines: two clients that
		// chose the same id never share one on an engine.
		legID = engineRequestID(t.id)
	}
	t.rec.RequestID = t.id
	t.rec.EngineRequestID = legID
	t.rec.Path = req.Path
	t.rec.CachedTokens = -1
	// Reuse stays "" until the lookup: a turn that fails before it is no
	// reuse miss.
	t.trace.tr = r.cfg.tracer
	t.legs = legs{req: req, id: legID, apiKey: r.cfg.apiKey, trace: &t.trace}
	t.bufs.b = &r.bufs
	t.proof = r.verification(t)
	return t
}

// maxRequestIDBytes bounds a client's X-Request-Id. An id that is longer,
// empty, or holds anything but visible ASCII (0x21 to 0x7e) is ignored: the
// router generates its own for both legs, the response and the TurnRecord.
const maxRequestIDBytes = 128

func validRequestID(id string) bool {
	if id == "" || len(id) > maxRequestIDBytes {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e {
			return false
		}
	}
	return true
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "bidikv-" + hex.EncodeToString(b[:])
}

// engineRequestID is the id a turn's legs carry for a client's id: the
// client's, for correlation, and 64 random bits.
func engineRequestID(client string) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return client + "-" + hex.EncodeToString(b[:])
}

func (t *turn) since() time.Duration { return t.r.cfg.clock().Sub(t.start) }

// miss records that the turn reuses no handle, and why.
func (t *turn) miss(reason MissReason) {
	t.rec.Reuse = ReuseMiss
	t.rec.MissReason = reason
}
