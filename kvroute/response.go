package kvroute

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/sse"
)

// Response is the decode engine's answer to one turn as it may reach a
// client: every kv_transfer_params removed at any depth, a stream's lines
// a client ignores or that name a handle dropped (sse.Scrub, ScrubEvent),
// and all other bytes as the engine sent them.
//
// A non-streaming response is complete when Do returns: Body holds it. A
// streaming response is read event by event with Next, or forwarded whole
// with WriteTo. Either way the caller must call Close, which aborts the
// decode request on the engine if the stream was not read to its end.
type Response struct {
	// StatusCode is the decode engine's status (2xx: errors are returned
	// by Do).
	StatusCode int
	// Header holds the decode engine's end-to-end headers (not Server,
	// Date, Content-Encoding nor any naming a KV handle) plus X-Request-Id
	// and X-Bidikv-Reuse (hit, miss, off, or local for a decode-local
	// turn).
	Header http.Header
	// Body is the whole body of a non-streaming response; nil for a stream.
	Body []byte

	t *turn
	// rt is the turn's retainer, which Do hands on (to): the Response
	// reports to it once D's answer is whole (kept) and ends the turn
	// through it (end).
	rt           *retainer
	ep           *endpoint
	live         int64     // the leg's tokens counted live on ep (memory.go)
	sent         time.Time // when the leg was sent
	added, asked bool      // the leg asked D for token ids: on the client's behalf, or the client itself
	tier         int       // a decode-local leg's tier estimate (decodeLeg.tier), checked against D's usage
	got          answer    // a body's answer, reported when Do hands on the retainer
	reported     bool      // a stream's answer was reported (keep)
	left         sync.Once
	body         io.ReadCloser
	stream       bool
	reader       *sse.Reader
	capture      capture.Stream
	pending      sse.Event // the first event, read by Do
	hasPending   bool
	first        bool
	ttft         time.Duration // Do's start to the first event handed to the caller
	err          error
	once         sync.Once
	// renderText: the capture compares D's first data event with the
	// render answer's id text, which Next releases after that event.
	renderText bool
	// buf is a buffered stream (buffered.go): D's whole answer, written
	// as the API's stream.
	buf *buffered
	// charge: the answer's bytes held, charged to WithLimits'
	// ChargeAnswer until Close (response.go).
	charge answerCharge
}

// Streaming reports whether the response is an SSE stream: the decode
// engine's, or a buffered stream's (WithDecodeMemory's BufferStreams),
// written from the engine's whole answer.
func (r *Response) Streaming() bool { return r.stream || r.buf != nil }

// Next returns the next event of a stream as raw SSE bytes, ready to write
// to a client, including the blank line that ends it. The slice is valid
// until the next call. At the end of a complete stream Next returns io.EOF
// and the decode handle has been retained. If the stream breaks, Next
// returns an error (an *UpstreamError in PhaseStream, or ErrStreamCut when
// the engine closed it before data: [DONE]) and nothing is retained.
func (r *Response) Next() ([]byte, error) {
	if r.err != nil {
		return nil, r.err
	}
	if r.buf != nil {
		return r.buf.next(r)
	}
	if !r.stream {
		r.err = errors.New("kvroute: Next on a non-streaming response")
		return nil, r.err
	}
	var ev sse.Event
	var err error
	if r.hasPending {
		ev, r.hasPending = r.pending, false
		r.pending = sse.Event{}
	} else {
		ev, err = r.reader.Next()
	}
	if err == nil && ev.Incomplete {
		// The stream ended inside an event: a client would not dispatch
		// it (the SSE rule), so it is not forwarded, and the stream ends
		// here.
		err = io.EOF
	}
	if err != nil {
		if errors.Is(err, io.EOF) {
			if r.capture.Done() {
				r.stop(nil)
				r.err = io.EOF
				r.recycle()
				return nil, io.EOF
			}
			err = ErrStreamCut
		}
		r.err = r.streamError(err)
		r.stop(r.err)
		return nil, r.err
	}
	out, ferr := r.capture.Forward(ev)
	if r.renderText && ev.HasData {
		// The capture no longer holds the render answer's text.
		r.renderText = false
		r.t.bufs.releaseRenderText()
	}
	if ferr != nil {
		// Data that may hold a handle but is not JSON: never forward it.
		r.err = r.streamError(ferr)
		r.stop(r.err)
		return nil, r.err
	}
	if r.capture.Done() {
		// Retain before the client sees data: [DONE], so that a client
		// that sends its next turn at once finds the handle.
		r.keep()
	}
	if !r.first {
		r.first = true
		r.ttft = r.t.since()
		r.t.rec.TTFT = r.ttft
	}
	r.t.rec.Bytes += int64(len(out))
	return out, nil
}

// ErrorEvent returns the SSE event that ends the stream after err, an
// error Next or WriteTo returned, in the shape of the turn's API (see
// API.StreamErrorShape; for Responses, numbered after the last event sent).
// Write it after the last event Next returned: every event Next returns
// is complete, so it starts on a fresh line.
func (r *Response) ErrorEvent(err error) []byte {
	var seq int64
	if s, ok := r.capture.(interface{ Sequence() (int64, bool) }); ok {
		if n, ok := s.Sequence(); ok {
			seq = n + 1
		}
	}
	return r.t.req.api.errors.event(HTTPStatus(err), err, seq)
}

func (r *Response) streamError(err error) error {
	var ue *UpstreamError
	if errors.As(err, &ue) || errors.Is(err, context.Canceled) {
		return err
	}
	return &UpstreamError{Phase: PhaseStream, Endpoint: r.ep.url, Status: r.StatusCode, Err: err}
}

// WriteTo writes the response to w: the body, or every event of the stream
// as it arrives, flushing when w supports it (an http.ResponseWriter, or
// anything with Flush() or Flush() error): after each event, except that
// events the decode engine sent together (already read when the one
// before is written) get one flush, after the last of them. The first two
// events (vLLM's role chunk and the first token) are always flushed at
// once. It
// returns the bytes written and the first error; io.EOF is not an error.
func (r *Response) WriteTo(w io.Writer) (int64, error) {
	if r.buf != nil {
		return r.buf.writeTo(r, w)
	}
	if !r.stream {
		n, err := w.Write(r.Body)
		return int64(n), err
	}
	sw := sse.NewWriter(w)
	var total int64
	for n := 0; ; n++ {
		ev, err := r.Next()
		if errors.Is(err, io.EOF) {
			return total, nil
		}
		if err != nil {
			return total, err
		}
		// One flush for the events D sent at once: an event is held
		// back only while the next one is already read. The first two
		// (vLLM's role chunk and the first token) always go at once.
		if n >= 2 && r.reader != nil && r.reader.Ready() {
			_, err = sw.Write(ev)
		} else {
			err = sw.WriteRaw(ev)
		}
		if err != nil {
			return total, err
		}
		total += int64(len(ev))
	}
}

// Close releases the response: a held answer's bytes go back to WithLimits'
// ChargeAnswer. If a stream was not read to its end, the decode request is
// aborted, so the engine frees its blocks, and nothing is retained.
func (r *Response) Close() error {
	if r.buf != nil {
		r.buf.end(r)
	}
	r.charge.giveBack()
	if r.stream && r.err == nil {
		r.err = ErrStreamCut
		r.rt.refused(RefuseClosedEarly)
		r.stop(context.Canceled)
	}
	r.release()
	return nil
}

// recycle returns the stream's buffer to the Router's pool at the end of a
// complete stream, from Next (the reader's own goroutine: a stream that is
// closed or breaks keeps its buffer, which another goroutine's Close could
// race with), when no event it returned may be used any more.
func (r *Response) recycle() {
	b := r.reader.Buffer()
	r.reader = nil
	if b == nil {
		return
	}
	r.t.bufs.recycleStream(b)
}

// to hands the Response the turn's retainer rt (Do calls it with the
// Response decode returned). A body's answer is reported to it at once
// and, unless it is written as a buffered stream, ends the turn; a stream
// reports its answer and ends the turn as it is read (Next, Close).
func (r *Response) to(rt *retainer) *Response {
	r.rt, rt.resp = rt, r
	if r.stream {
		return r
	}
	a := r.got
	r.got = answer{}
	rt.kept(a)
	if r.buf != nil {
		r.buf.start(r)
		return r
	}
	r.t.rec.TTFT = r.t.since()
	r.t.rec.Bytes = int64(len(r.Body))
	rt.end("", nil)
	return r
}

// keep reports D's answer to the retainer once the stream's capture has
// seen its final event, the first time it is called.
func (r *Response) keep() {
	if r.reported {
		return
	}
	r.reported = true
	r.leave()
	a := answer{decode: r.ep.url, added: r.added, asked: r.asked, streamed: true}
	if r.added || r.asked {
		a.ids.prompt, a.ids.generated, a.ids.ok = r.capture.IDs()
		r.t.bufs.promptIDs = a.ids.prompt
	}
	a.handle, a.blocks, a.reply = r.capture.Handle(), r.capture.HandleBlocks(), r.capture.Reply()
	if r.tier > 0 {
		confirmLocal(r.t, r.ep, r.tier, r.capture.Usage()) // the usage chunk, when the client asked for it
	}
	r.rt.kept(a)
	// The capture's handle buffer goes back to the pool once the handle
	// is retained (the store holds its own encoding). This runs on the
	// goroutine that calls Next, the only one the capture writes the
	// buffer from; a stream that breaks or is closed keeps it.
	if hc, ok := r.capture.(interface{ ReleaseHandleBuffer() []byte }); ok {
		if b := hc.ReleaseHandleBuffer(); b != nil {
			r.t.bufs.releaseHandle(b)
		}
	}
}

// release closes the upstream body once, which cancels the decode
// request (transport.Client's body ends the exchange's context).
func (r *Response) release() {
	r.once.Do(func() {
		_ = r.body.Close()
		r.ep.inflight.Add(-1)
		r.leave()
	})
}

// leave ends the leg's count live on its engine, once: when D's answer is
// whole (before it is retained: the engine has finished the request, and
// what it still holds of it is the hold the retain adds to the ledger, not
// live work), or when the Response is released.
func (r *Response) leave() {
	r.left.Do(func() { r.t.r.mem.depart(r.ep, r.live) })
}

// stop ends a stream and with it the turn: whole (err nil; its answer was
// reported when the capture saw its final event), broken, or closed by the
// caller (context.Canceled).
func (r *Response) stop(err error) {
	if err != nil && !errors.Is(err, context.Canceled) {
		r.t.r.hp.failed(r.ep, err)
	}
	r.release()
	r.rt.end(PhaseStream, err)
}

// errUnsafeAnswer fails a decode answer that cannot be forwarded safely:
// it may hide a KV handle (see sse.Scrub). Such a failure is not redone:
// the same request would likely bring the same answer.
var errUnsafeAnswer = errors.New("kvroute: the decode engine's answer cannot be forwarded safely (it may hide a KV handle)")

// readBody reads a non-streaming answer, takes its handle, and keeps for
// the caller what sse.Scrub lets through: every kv_transfer_params
// removed, at any depth; an answer that is not JSON, or holds members
// only handles have elsewhere, fails closed.
//
// What the retain phase needs of the answer waits in r.got until Do hands
// the Response the turn's retainer (to). For a buffered stream (buf), the
// answer must be one the API's stream can be written from before anything
// of it is retained, and the turn ends when the stream has been written.
//
// The answer's bytes are charged to WithLimits' ChargeAnswer as they are
// held (answerCharge); a failed read gives them back at once, a read
// answer when the Response is closed.
func (r *Response) readBody(ctx context.Context, buf *buffered, declared int64) (err error) {
	defer r.release()
	r.charge = answerCharge{fn: r.t.r.cfg.limits.ChargeAnswer, ctx: ctx}
	defer func() {
		if err != nil {
			r.charge.giveBack()
		}
	}()
	limit := r.t.r.cfg.maxBodyBytes
	var free int64 // charged before it arrives
	if declared > 0 && declared <= limit {
		if !r.charge.take(declared) {
			return errAnswerCharge
		}
		free = declared
	}
	// A declared length is read into one buffer of that size, allocated
	// once it is charged.
	b, err := readSized(&chargedReader{r: r.body, c: &r.charge, free: free}, declared, limit, nil)
	if errors.Is(err, errAnswerCharge) {
		return err
	}
	if err != nil {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: err}
	}
	// D's handle's block list is read as the answer is validated.
	var obj jsonraw.Object
	blocks, perr := kvhandle.ResetAnswer(&obj, b)
	isObject := perr == nil
	if !isObject && !errors.Is(perr, jsonraw.ErrNotObject) {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: fmt.Errorf("%w: not JSON", errUnsafeAnswer)}
	}
	var handle []byte
	var ids tokenIDs
	if isObject {
		if r.tier > 0 { // what D computed, whatever becomes of its answer
			u, _ := obj.Get("usage")
			confirmLocal(r.t, r.ep, r.tier, u)
		}
		if h, ok := obj.Get(kvKey); ok && !jsonraw.IsNull(h) {
			handle = append([]byte(nil), h...)
		}
		if r.added || r.asked {
			ids = bodyTokenIDs(obj, &r.t.bufs)
			r.t.bufs.promptIDs = ids.prompt
		}
		if r.added {
			// The client did not ask for token ids: they never reach it.
			b, _ = capture.StripTokenIDs(b)
		}
	}
	out, _, err := sse.Scrub(nil, b)
	if err != nil {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: fmt.Errorf("%w: %w", errUnsafeAnswer, err)}
	}
	if buf != nil {
		if err := buf.check(r, out, isObject); err != nil {
			return err
		}
	}
	r.Body = out
	r.Header.Del("Content-Length")
	if !isObject {
		// Valid JSON but not an object: nothing to capture.
		r.got = answer{notJSON: true}
		return nil
	}
	r.got = answer{decode: r.ep.url, added: r.added, asked: r.asked, handle: handle, blocks: blocks,
		reply: r.t.req.api.impl.bodyReply(obj), ids: ids}
	r.buf = buf
	return nil
}

// bodyTokenIDs reads the token ids of a non-streaming answer: the prompt's
// at the top level (chat) or in choice 0 (completions), the generated ones
// in choice 0.
func bodyTokenIDs(obj jsonraw.Object, bufs *turnBufs) tokenIDs {
	var prompt, gen []byte
	if v, ok := obj.Get(capture.PromptTokenIDsKey); ok {
		prompt = v
	}
	choices, _ := obj.Get("choices")
	_ = jsonraw.Elements(choices, func(c []byte) error {
		if v, ok := jsonraw.Lookup(c, capture.PromptTokenIDsKey); ok && prompt == nil {
			prompt = v
		}
		gen, _ = jsonraw.Lookup(c, capture.TokenIDsKey)
		return errStop
	})
	var p []uint32
	okP := false
	if bufs.renderText != nil && bufs.rendered != nil && bytes.Equal(prompt, bufs.renderText) {
		// Spelled as the render answer's ids: the rendered ones (kept
		// until the turn ends, after the answer is retained).
		p, okP = bufs.rendered, true
	} else {
		p, okP = capture.AppendTokenIDs(nil, prompt)
	}
	g, okG := capture.AppendTokenIDs(nil, gen)
	return tokenIDs{prompt: p, generated: g, ok: okP && okG}
}

// errAnswerCharge fails a turn whose decode answer did not fit WithLimits'
// ChargeAnswer: 503 (HTTPStatus), not redone.
var errAnswerCharge = errors.New("kvroute: the decode answer does not fit the memory bound for answers held (WithLimits' ChargeAnswer); retry later")

// answerCharge is what a Response charged to WithLimits' ChargeAnswer for
// the answer it holds.
type answerCharge struct {
	fn  func(context.Context, int64) bool // nil: nothing is charged
	ctx context.Context
	n   int64 // charged, not given back
}

// take charges n more bytes, or reports that they do not fit.
func (c *answerCharge) take(n int64) bool {
	if c.fn == nil || n <= 0 {
		return true
	}
	if !c.fn(c.ctx, n) {
		return false
	}
	c.n += n
	return true
}

// giveBack gives back everything charged, once.
func (c *answerCharge) giveBack() {
	if c.n > 0 {
		n := c.n
		c.n = 0
		c.fn(c.ctx, -n)
	}
}

// chargedReader charges the bytes it reads beyond the first free (the
// answer's declared length, charged before) as they arrive.
type chargedReader struct {
	r    io.Reader
	c    *answerCharge
	free int64
}

func (cr *chargedReader) Read(p []byte) (int, error) {
	n, err := cr.r.Read(p)
	if over := int64(n) - cr.free; over > 0 {
		cr.free = 0
		if !cr.c.take(over) {
			return 0, errAnswerCharge
		}
	} else {
		cr.free -= int64(n)
	}
	return n, err
}
