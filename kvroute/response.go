package kvroute

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"sync"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
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
	// Header holds the decode engine's end-to-end headers plus
	// X-Request-Id and X-Bidikv-Reuse (hit, miss, off, or local for a
	// decode-local turn).
	Header http.Header
	// Body is the whole body of a non-streaming response; nil for a stream.
	Body []byte

	t          *turn
	ep         *endpoint
	body       io.ReadCloser
	stream     bool
	reader     *sse.Reader
	capture    capture.Stream
	retained   bool
	pending    sse.Event // the first event, read by Do
	hasPending bool
	first      bool
	err        error
	once       sync.Once
	// renderText: the capture compares D's first data event with the
	// render answer's id text, which Next releases after that event.
	renderText bool
}

// Streaming reports whether the response is an SSE stream.
func (r *Response) Streaming() bool { return r.stream }

// Reuse reports whether the turn reused retained KV (ReuseHit), ran
// decode-local (ReuseLocal), did not reuse (ReuseMiss), or had reuse
// disabled (ReuseOff).
func (r *Response) Reuse() ReuseOutcome { return r.t.rec.Reuse }

// RequestID is the X-Request-Id both legs carried.
func (r *Response) RequestID() string { return r.t.id }

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
				r.end(nil)
				r.err = io.EOF
				r.recycle()
				return nil, io.EOF
			}
			err = ErrStreamCut
		}
		r.err = r.streamError(err)
		r.end(r.err)
		return nil, r.err
	}
	out, ferr := r.capture.Forward(ev)
	if r.renderText && ev.HasData {
		// The capture no longer holds the render answer's text.
		r.renderText = false
		r.t.releaseRenderText()
	}
	if ferr != nil {
		// Data that may hold a handle but is not JSON: never forward it.
		r.err = r.streamError(ferr)
		r.end(r.err)
		return nil, r.err
	}
	if r.capture.Done() {
		// Retain before the client sees data: [DONE], so that a client
		// that sends its next turn at once finds the handle.
		r.retainOnce()
	}
	if !r.first {
		r.first = true
		r.t.rec.TTFT = r.t.since()
	}
	r.t.rec.Bytes += int64(len(out))
	return out, nil
}

// ErrorEvent returns the SSE event that ends the stream after err, an
// error Next or WriteTo returned, in the shape of the turn's API (see
// StreamErrorEvent; for Responses, numbered after the last event sent).
// Write it after the last event Next returned: every event Next returns
// is complete, so it starts on a fresh line.
func (r *Response) ErrorEvent(err error) []byte {
	var seq int64
	if s, ok := r.capture.(interface{ Sequence() (int64, bool) }); ok {
		if n, ok := s.Sequence(); ok {
			seq = n + 1
		}
	}
	return r.t.req.api.streamError(HTTPStatus(err), err, seq)
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

// Close releases the response. If a stream was not read to its end, the
// decode request is aborted, so the engine frees its blocks, and nothing
// is retained.
func (r *Response) Close() error {
	if r.stream && r.err == nil {
		r.err = ErrStreamCut
		r.t.rec.StoreRefusal = RefuseClosedEarly
		r.end(context.Canceled)
	}
	r.release()
	return nil
}

// maxStreamHint bounds the buffer a stream starts with: a huge stream grows
// its own rather than making every later stream take one as large.
const maxStreamHint = 1 << 20

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
	r.t.r.streamBuf.Store(int64(min(cap(b), maxStreamHint)))
	r.t.r.bufs.Put(b)
}

// retainOnce retains D's handle from the stream's capture, the first time
// it is called.
func (r *Response) retainOnce() {
	if r.retained {
		return
	}
	r.retained = true
	r.t.tokenIDs(r.capture)
	r.t.retain(r.capture.Handle(), r.capture.Reply())
	r.releaseHandle()
}

// releaseHandle returns the capture's handle buffer to the Router's pool
// once the handle is retained (the store holds its own encoding). It runs
// on the goroutine that calls Next, the only one the capture writes the
// buffer from; a stream that breaks or is closed keeps it.
func (r *Response) releaseHandle() {
	hc, ok := r.capture.(interface{ ReleaseHandleBuffer() []byte })
	if !ok {
		return
	}
	if b := hc.ReleaseHandleBuffer(); b != nil {
		r.t.r.handleBuf.Store(int64(min(len(b), maxStreamHint)))
		r.t.r.bufs.Put(b)
	}
}

// release closes the upstream body once, which cancels the decode
// request (transport.Client's body ends the exchange's context).
func (r *Response) release() {
	r.once.Do(func() {
		_ = r.body.Close()
		r.ep.inflight.Add(-1)
	})
}

// end finishes a stream: retains D's handle when the stream completed,
// reports the turn.
func (r *Response) end(err error) {
	t := r.t
	if err == nil {
		r.retainOnce()
	} else {
		if t.rec.StoreRefusal == "" {
			t.rec.StoreRefusal = RefuseStreamError
		}
		if !errors.Is(err, context.Canceled) {
			t.r.hp.failed(r.ep, err)
			t.rec.Err = err
			t.rec.ErrPhase = PhaseStream
			t.r.stats.failures.Add(1)
		}
	}
	r.release()
	t.endPhases(err)
	t.finish()
}

// errUnsafeAnswer fails a decode answer that cannot be forwarded safely:
// it may hide a KV handle (see sse.Scrub). Such a failure is not redone:
// the same request would likely bring the same answer.
var errUnsafeAnswer = errors.New("kvroute: the decode engine's answer cannot be forwarded safely (it may hide a KV handle)")

// readBody reads a non-streaming answer, takes its handle, and keeps for
// the caller what sse.Scrub lets through: every kv_transfer_params
// removed, at any depth; an answer that is not JSON, or holds members
// only handles have elsewhere, fails closed.
func (r *Response) readBody() error {
	defer r.release()
	b, err := readLimited(r.body, r.t.r.cfg.maxBodyBytes)
	if err != nil {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: err}
	}
	obj, perr := jsonraw.Parse(b)
	isObject := perr == nil
	if !isObject && !errors.Is(perr, jsonraw.ErrNotObject) {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: fmt.Errorf("%w: not JSON", errUnsafeAnswer)}
	}
	var handle []byte
	if isObject {
		if h, ok := obj.Get(kvKey); ok && !jsonraw.IsNull(h) {
			handle = append([]byte(nil), h...)
		}
		if r.t.idsAdded || r.t.idsAsked {
			r.t.bodyTokenIDs(obj)
		}
		if r.t.idsAdded {
			// The client did not ask for token ids: they never reach it.
			b, _ = capture.StripTokenIDs(b)
		}
	}
	out, _, err := sse.Scrub(nil, b)
	if err != nil {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: fmt.Errorf("%w: %w", errUnsafeAnswer, err)}
	}
	r.Body = out
	r.Header.Del("Content-Length")
	if !isObject {
		// Valid JSON but not an object: nothing to capture.
		r.t.rec.StoreRefusal = RefuseNotJSON
		r.finishBody()
		return nil
	}
	r.t.retain(handle, r.t.req.api.bodyReply(obj))
	r.finishBody()
	return nil
}

func (r *Response) finishBody() {
	r.t.rec.TTFT = r.t.since()
	r.t.rec.Bytes = int64(len(r.Body))
	r.t.finish()
}

// retain stores D's handle for the next turn, or records why not.
func (t *turn) retain(handle []byte, reply *Reply) {
	r := t.r
	if !r.cfg.reuse {
		t.rec.StoreRefusal = RefuseReuseOff
		return
	}
	if t.rec.Reuse == ReuseLocal {
		// A plain request: no handle expected, the earlier one stays.
		t.rec.StoreRefusal = RefuseDecodeLocal
		return
	}
	// D emits a handle when it finished normally and was sent P's (a
	// plain request, the local fallback, gets none).
	expected := !t.local && (reply.FinishReason == "stop" || reply.FinishReason == "length")
	if handle == nil {
		_, streamsHandles := r.streamHandles.Load(t.decodeURL)
		switch {
		case t.stream && !t.req.api.streamHandles():
			// The API's streams never carry one (vLLM's Messages): not an
			// engine's fault, nothing to warn about.
			t.rec.StoreRefusal = RefuseNoStreamHandle
			return
		case t.rec.Stream && !streamsHandles:
			r.stats.noStreamHandle.Add(1)
			r.noStreamHandle.Do(func() {
				r.log.Warn("kvroute: the decode engine sends no kv_transfer_params in streams (stock vLLM); streaming turns cannot reuse KV. Use engines with PR #40186 or non-streaming requests.")
			})
			t.rec.StoreRefusal = RefuseNoStreamHandle
		default:
			t.rec.StoreRefusal = RefuseNoHandle
			if expected {
				r.stats.noDecodeHandle.Add(1)
				t.rec.NoHandle = PhaseDecode
				r.log.once(context.Background(), "no_decode_handle:"+t.decodeURL,
					"kvroute: a decode engine finished a turn without kv_transfer_params; nothing is retained (is kv_connector_extra_config.bidirectional_kv_xfer on?)",
					slog.String("endpoint", t.decodeURL))
			}
		}
		return
	}
	if t.stream {
		r.streamHandles.LoadOrStore(t.decodeURL, struct{}{})
	}
	if reply.FinishReason != "stop" && reply.FinishReason != "length" {
		t.rec.StoreRefusal = RefuseFinishPrefix + Refusal(reply.FinishReason)
		return
	}
	hi, err := kvhandle.Check(handle, r.cfg.blockSize)
	if err != nil {
		t.rec.StoreRefusal = RefuseUnusableHandle
		if errors.Is(err, kvhandle.ErrInvalid) {
			t.rec.StoreRefusal = RefuseInvalidHandle
			r.invalidHandle(PhaseDecode, t.decodeURL, err)
		}
		return
	}
	r.restarts.sawEngineID(t.decodeURL, handle)
	if hi.PushMode {
		t.rec.StoreRefusal = RefusePushHandle
		r.stats.pushHandles.Add(1)
		return
	}
	if t.bg != nil && t.rendered == nil && !t.req.api.tokenIDs() {
		t.retainRendered(handle, hi.Tokens, reply)
		return
	}
	fp, hard := t.fingerprint(hi.Tokens)
	// The fingerprint and the entry are built in pooled buffers: both are
	// copied into the entry and the store respectively.
	defer r.bufs.Put(fp)
	if hard != "" {
		t.rec.StoreRefusal = hard
		r.stats.refusals.Add(1)
		return
	}
	ret, err := r.ident.Key(t.req, t.cands, reply)
	if err != nil {
		t.rec.StoreRefusal = RefuseIdentifierError
		r.stats.refusals.Add(1)
		return
	}
	// A refusal with a key: the turn may be retained, but only for token
	// verification.
	if ret.Key == "" || (ret.Refusal != "" && fp == nil) {
		t.rec.StoreRefusal = ret.Refusal
		r.stats.refusals.Add(1)
		return
	}
	e := entry.Entry{Created: r.cfg.clock(), Endpoint: t.decodeURL, Tokens: hi.Tokens, Check: ret.Check,
		ContentOK: ret.Refusal == "", FP: fp, Handle: handle}
	t.rec.StoreRefusal, t.rec.Stored = r.handles.retain(ret.Key, e, t.id)
}

// retainRendered retains the handle of a turn on an API without token ids
// whose prompt is being rendered in the background (bgrender.go): when the
// render has answered, or for a breaker's trial render that has not, when
// it answers, after the turn has ended (TurnRecord.StoreRefusal
// RefuseRenderPending; Stats.Stored counts it then). The Identifier's key
// and the handle are taken now.
func (t *turn) retainRendered(handle []byte, tokens int, reply *Reply) {
	r := t.r
	if v, ok := t.req.Field("n"); ok && !jsonraw.IsNull(v) {
		if n, ok := lenientInt(v); !ok || n != 1 {
			t.rec.StoreRefusal = RefuseN
			r.stats.refusals.Add(1)
			return
		}
	}
	ret, err := r.ident.Key(t.req, t.cands, reply)
	if err != nil || ret.Key == "" {
		t.rec.StoreRefusal = ret.Refusal
		if err != nil {
			t.rec.StoreRefusal = RefuseIdentifierError
		}
		r.stats.refusals.Add(1)
		return
	}
	e := entry.Entry{Created: r.cfg.clock(), Endpoint: t.decodeURL, Tokens: tokens, Check: bytes.Clone(ret.Check),
		ContentOK: ret.Refusal == "", Handle: bytes.Clone(handle)}
	key, id, path := ret.Key, t.id, t.req.Path
	store := func(ids []uint32, err error) (Refusal, bool) {
		if err != nil || len(ids) == 0 {
			r.stats.tokenFallbacks.Add(1)
			r.log.once(context.Background(), "no_render:"+path, "kvroute: no engine renders "+path+" prompts; such turns cannot be verified by tokens and are not reused",
				slog.String("path", path))
			return RefuseUnrendered, false
		}
		bs := r.cfg.blockSize
		if bs == 0 {
			bs = DefaultBlockSize
		}
		n := min(len(ids), tokens)
		fp := fingerprint.AppendFrom(r.bufs.Get(fingerprint.Size(n, bs)), fingerprint.Prefix{}, ids, nil, n, bs)
		defer r.bufs.Put(fp)
		e.FP = fp
		return r.handles.retain(key, e, id)
	}
	ids, err, done := t.bg.result(func(ids []uint32, err error) { store(ids, err) })
	if !done {
		t.rec.StoreRefusal = RefuseRenderPending
		return
	}
	t.rec.StoreRefusal, t.rec.Stored = store(ids, err)
}

// fingerprint returns the token fingerprint of D's blocks in token mode
// (nil in content mode or when the engine sent no token ids), or a refusal
// that holds in every mode. The fingerprint is built in a buffer from the
// Router's pool, which the caller puts back.
func (t *turn) fingerprint(tokens int) (fingerprint.Fingerprint, Refusal) {
	r := t.r
	if v, ok := t.req.Field("n"); ok && !jsonraw.IsNull(v) {
		if n, ok := lenientInt(v); !ok || n != 1 {
			return nil, RefuseN // which choice's tokens D's blocks hold is unknown
		}
	}
	if r.cfg.verification != VerifyTokens {
		return nil, ""
	}
	bs := r.cfg.blockSize
	if bs == 0 {
		bs = DefaultBlockSize
	}
	if !t.req.api.tokenIDs() && tokens > 0 {
		// An API without token ids (Responses, Messages): fingerprint the
		// prompt as the engines render it, which D's blocks hold first;
		// the reply's tokens stay unverified and are never reused. The
		// prompt was rendered for verification, or in the background
		// (retainRendered); it is never rendered here, on the answer's
		// path.
		ids := t.rendered
		if len(ids) == 0 {
			r.stats.tokenFallbacks.Add(1)
			r.log.once(context.Background(), "no_render:"+t.req.Path, "kvroute: no engine renders "+t.req.Path+" prompts; such turns cannot be verified by tokens and are not reused",
				slog.String("path", t.req.Path))
			return nil, ""
		}
		n := min(len(ids), tokens)
		return fingerprint.AppendFrom(r.bufs.Get(fingerprint.Size(n, bs)), t.fpPrefix, ids, nil, n, bs), ""
	}
	if !t.hasIDs || tokens <= 0 {
		r.stats.tokenFallbacks.Add(1)
		r.log.once(context.Background(), "no_token_ids", "kvroute: the decode engine sent no token ids (return_token_ids); such turns are retained under content rules only (see WithVerification)")
		return nil, ""
	}
	// The verified prefix is hashed again only when D's prompt ids differ
	// from the rendered ones there (fingerprintFrom compares them).
	fp := fingerprint.AppendFrom(r.bufs.Get(fingerprint.Size(tokens, bs)), t.fpPrefix, t.promptIDs, t.genIDs, tokens, bs)
	if fp == nil {
		r.log.once(context.Background(), "token_count", "kvroute: the decode engine's token ids are fewer than its handle's remote_num_tokens; such turns are retained under content rules only")
	}
	return fp, ""
}

// tokenIDs takes the token ids a stream's capture collected.
func (t *turn) tokenIDs(c capture.Stream) {
	if !t.idsAdded && !t.idsAsked {
		return
	}
	t.promptIDs, t.genIDs, t.hasIDs = c.IDs()
}

// bodyTokenIDs reads the token ids of a non-streaming answer: the prompt's
// at the top level (chat) or in choice 0 (completions), the generated ones
// in choice 0.
func (t *turn) bodyTokenIDs(obj jsonraw.Object) {
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
	if t.renderText != nil && t.rendered != nil && bytes.Equal(prompt, t.renderText) {
		// Spelled as the render answer's ids: the rendered ones (kept
		// until the turn ends, after the answer is retained).
		p, okP = t.rendered, true
	} else {
		p, okP = capture.AppendTokenIDs(nil, prompt)
	}
	g, okG := capture.AppendTokenIDs(nil, gen)
	t.promptIDs, t.genIDs, t.hasIDs = p, g, okP && okG
}
