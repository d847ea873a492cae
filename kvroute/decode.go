package kvroute

import (
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
	"github.com/bidikv/bidikv/transport"
)

// Members removed from the client's body on the decode leg.
var decodeDrop = []string{kvKey, "conversation_id"}

// errLeaseExpired means P's lease on its blocks had less than expiryGuard
// left when the decode leg was to be sent: D could read freed blocks.
var errLeaseExpired = errors.New("kvroute: the prefill engine's lease ran out before the decode leg")

// decodeLeg is what a turn's decode legs send: the body (message 4: the
// client's body with P's handle, or with no kv_transfer_params at all when
// P gave none; the miss handle never reaches a decode engine) and whether
// it asks for token ids: added on the client's behalf (they are then
// stripped from the answer), or asked by the client itself.
type decodeLeg struct {
	body         legBody
	added, asked bool
	buf          *buffered // a buffered stream's leg (buffered.go): non-streaming
	tier         int       // a decode-local leg chosen on a tier estimate: the tokens D should reload (confirmLocal)
}

// newDecodeLeg builds the decode leg for P's handle; askIDs says the
// turn's verification needs D's token ids (return_token_ids); buf, a
// buffered stream's leg, that it runs non-streaming.
func newDecodeLeg(req *Request, pHandle []byte, askIDs bool, buf *buffered) decodeLeg {
	l := decodeLeg{buf: buf}
	set := make([]jsonraw.Member, 0, 3)
	drop := decodeDrop
	if buf != nil {
		set, drop = append(set, bufferedSet), bufferedDrop
	}
	if pHandle != nil {
		set = append(set, jsonraw.Member{Key: kvKey, Value: pHandle})
	}
	if v, ok := req.Field("return_token_ids"); ok {
		l.asked, _ = lenientBool(v)
	}
	if askIDs && !l.asked {
		l.added = true
		set = append(set, jsonraw.Member{Key: "return_token_ids", Value: jsonTrue})
	}
	l.body = req.obj.EditPieces(make(legBody, 0, 24), drop, set...)
	return l
}

// askIDs reports whether the turn's verification needs D's token ids.
func (t *turn) askIDs() bool {
	lh, ok := t.proof.(legHelper)
	return ok && lh.decodeIDs()
}

// decode sends the decode leg with P's handle and wraps D's answer; the
// decode engine that held the retained KV is preferred (affinity). While
// nothing has reached the caller, a leg that failed before any connection
// was made (so no engine can have read P's handle) is sent again, with
// the same handle, to another decode engine, as long as P's lease still
// has expiryGuard left. Any other failure is returned; Do decides whether
// to redo the turn.
func decode(ctx context.Context, t *turn, p prefilled, affinity string, tr *tries) (*Response, error) {
	r := t.r
	streamed := newDecodeLeg(t.req, p.handle, t.askIDs(), nil)
	var last error
	for {
		if tr.decodeLegs >= r.cfg.decodeAttempts {
			return nil, last
		}
		ep, err := r.decode.pick(ctx, r.selector, t.req, affinity, t.req.hint, tr.avoidD)
		if errors.Is(err, ErrNoEndpoint) && len(tr.avoidD) > 0 {
			tr.avoidD = tr.avoidD[:0] // every engine failed once: try them again
			ep, err = r.decode.pick(ctx, r.selector, t.req, affinity, t.req.hint, tr.avoidD)
		}
		if err != nil {
			if last != nil {
				return nil, last
			}
			return nil, err
		}
		tr.decodeLegs++
		if p.handle != nil && r.cfg.clock().Sub(p.done) > r.cfg.lease-expiryGuard {
			return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: p.endpoint, Err: errLeaseExpired}
		}
		leg := streamed
		if b := bufferFor(t, ep, p.handle); b != nil {
			leg = newDecodeLeg(t.req, p.handle, t.askIDs(), b)
		}
		resp, err := send(ctx, t, ep, leg, p)
		if err == nil {
			return resp, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		if unhealthy(err, false) {
			r.hp.failed(ep, err)
		}
		tr.avoidD = append(tr.avoidD, ep.url)
		if !redoable(err) || (p.handle != nil && !unsent(err)) || !tr.againAfter(err, r.decode) {
			return nil, err
		}
		last = err
		affinity = ""
	}
}

// decodeLocal sends a decode-local turn to w.local, the decode engine that
// holds its conversation, as a plain request: no kv_transfer_params at
// all. The Chooser's reservation ends with the engine's first event (or
// body).
func decodeLocal(ctx context.Context, t *turn, w way, tr *tries) (*Response, error) {
	defer w.chose.Release()
	ep := w.local
	tr.decodeLegs++
	leg := newDecodeLeg(t.req, nil, t.askIDs(), nil)
	leg.tier = w.chose.tier
	resp, err := send(ctx, t, ep, leg, prefilled{reuse: ReuseLocal, prompt: w.prompt})
	if err == nil {
		return resp, nil
	}
	if ctx.Err() == nil && unhealthy(err, false) {
		t.r.hp.failed(ep, err)
	}
	tr.avoidD = append(tr.avoidD, ep.url)
	return nil, err
}

// send sends one decode leg to ep within its trace phase; p is what the
// prefill phase handed on (nothing of a decode-local leg's but its reuse
// and prompt).
func send(ctx context.Context, t *turn, ep *endpoint, leg decodeLeg, p prefilled) (*Response, error) {
	dctx := t.trace.startDecode(ctx, ep.url)
	resp, err := open(dctx, t, ep, leg, p)
	t.trace.decodeDone(dctx, resp != nil && resp.stream, ep.url, err)
	return resp, err
}

// redo reports whether a turn whose decode leg failed with err may run
// again as a plain miss: nothing reached the caller (Do has not returned),
// the failure is one another engine may not repeat, decode legs are left,
// and after a timeout another engine may answer (againAfter).
func (tr *tries) redo(ctx context.Context, t *turn, err error) bool {
	return ctx.Err() == nil && redoable(err) && tr.decodeLegs < t.r.cfg.decodeAttempts && !t.r.closed.Load() &&
		tr.againAfter(err, t.r.decode)
}

// againAfter reports whether another decode leg may follow one that failed
// with err. A leg that timed out (no headers within WithTimeouts' FirstByte,
// or no first event within WithTimeouts' Idle) cost the whole timeout, and
// the engine may be stalled for every request: another leg, with another
// prefill, follows only for an engine this turn has not tried that is
// healthy now, and only after the turn's first timeout. So a turn waits
// for silent decode engines at most twice the timeout, and never sends
// the same silent engine a new prefill's handle.
func (tr *tries) againAfter(err error, decode *pool) bool {
	if !timedOut(err) {
		return true
	}
	tr.decodeTimeouts++
	return tr.decodeTimeouts == 1 && decode.hasOther(tr.avoidD)
}

// timedOut reports whether a decode leg failed for want of an answer:
// no headers within the first-byte deadline, or no first event within the
// idle deadline.
func timedOut(err error) bool {
	return errors.Is(err, transport.ErrFirstByteTimeout) || errors.Is(err, transport.ErrIdleTimeout)
}

// redoable reports whether a failed decode leg is worth another engine:
// connection failures and timeouts, 5xx answers, a 2xx whose body or first
// event failed, and a lapsed P lease. An engine's 4xx is the request's
// fault and is passed to the client.
func redoable(err error) bool {
	switch {
	case errors.Is(err, errLeaseExpired):
		return true
	case errors.Is(err, errUnsafeAnswer), errors.Is(err, errNotAnswer):
		return false // deterministic: not worth another prefill and decode
	}
	var ue *UpstreamError
	if !errors.As(err, &ue) || errors.Is(err, context.Canceled) {
		return false
	}
	return ue.Status == 0 || ue.Status >= 500 || ue.Status/100 == 2
}

// unsent reports whether err is a failure to connect: the request never
// reached an engine, so no engine read the handle it carried.
func unsent(err error) bool {
	var oe *net.OpError
	return errors.As(err, &oe) && oe.Op == "dial"
}

// open sends one decode leg to ep and wraps D's answer. A stream's first
// event is read before it returns, so that a stream that breaks at once
// can still be retried: nothing has reached the caller yet. p says what
// X-Bidikv-Reuse tells the client and the prompt's tokens.
func open(ctx context.Context, t *turn, ep *endpoint, leg decodeLeg, p prefilled) (*Response, error) {
	r := t.r
	t.rec.DecodeEndpoint = ep.url
	// No context of its own: closing the body transport.Client.Do
	// returns (Response.release) cancels the exchange's context.
	hreq, err := t.legs.request(ctx, PhaseDecode, ep, leg.body)
	if err != nil {
		return nil, err
	}
	ep.inflight.Add(1)
	live := r.mem.arrive(t, ep, p.prompt)
	sent := r.cfg.clock()
	dl := transport.Deadlines{FirstByte: r.cfg.firstByteTimeout, Idle: r.cfg.idleTimeout}
	if leg.buf != nil {
		// The engine answers when it has decoded the whole turn.
		dl.FirstByte = r.cfg.bufferedTimeout
	}
	resp, err := r.client.do(hreq, PhaseDecode, ep, dl)
	if err != nil {
		ep.inflight.Add(-1)
		r.mem.depart(ep, live)
		return nil, err
	}
	t.rec.FirstByte = r.cfg.clock().Sub(sent)
	out := &Response{StatusCode: resp.StatusCode, Header: http.Header{}, t: t, ep: ep, live: live, body: resp.Body,
		sent: sent, added: leg.added, asked: leg.asked, tier: leg.tier}
	transport.CopyHeader(out.Header, resp.Header)
	dropUnsafeHeaders(out.Header)
	// The router's two headers in one backing array (canonical names).
	own := []string{t.id, string(p.reuse)}
	out.Header[headerRequestID] = own[0:1:1]
	out.Header[headerReuse] = own[1:2:2]
	if err := r.client.check(resp, PhaseDecode, ep); err != nil {
		out.release()
		return nil, err
	}
	if !identityEncoded(resp.Header) {
		out.release()
		return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: ep.url, Status: resp.StatusCode,
			Err: fmt.Errorf("%w: it is compressed (a Content-Encoding other than identity)", errUnsafeAnswer)}
	}
	if isEventStream(resp.Header.Get("Content-Type")) {
		if err := out.openStream(resp); err != nil {
			return nil, err
		}
	} else if err := out.readBody(ctx, leg.buf, resp.ContentLength); err != nil {
		return nil, err
	}
	r.hp.succeeded(ep)
	return out, nil
}

// openStream sets up the capture of D's stream and reads its first event.
func (o *Response) openStream(resp *http.Response) error {
	t, bufs := o.t, &o.t.bufs
	ids := o.added || o.asked
	o.stream = true
	o.Header.Del("Content-Length")
	// A pooled buffer as large as the last stream needed (D's first chunk
	// carries the prompt's ids in token mode); Next returns it at the
	// stream's end.
	o.reader = sse.NewReader(resp.Body, t.r.maxEvent, sse.WithBuffer(bufs.streamBuffer()))
	o.capture = t.req.api.newStream(ids, o.added)
	if ib, ok := o.capture.(interface{ UseIDBuffer([]uint32) }); ok && ids {
		// The prompt's ids go into a pooled slice as large as the last
		// prompt's, returned when the turn ends.
		ib.UseIDBuffer(bufs.streamIDBuffer())
	}
	if hc, ok := o.capture.(interface{ UseHandleBuffer([]byte) }); ok {
		// D's handle goes into a pooled buffer as large as the last one,
		// returned once the handle is retained.
		hc.UseHandleBuffer(bufs.handleBuffer())
	}
	if ec, ok := o.capture.(interface{ ExpectPromptIDs([]byte, []uint32) }); ok && ids && bufs.renderText != nil && bufs.rendered != nil {
		// D's prompt ids, when spelled as the render answer's, are the
		// rendered ones: not parsed again.
		ec.ExpectPromptIDs(bufs.renderText, bufs.rendered)
		o.renderText = true
	}
	ev, err := o.reader.Next()
	if err == nil && ev.Incomplete {
		err = io.EOF // cut inside its first event, which is not forwarded
		if !utf8.Valid(ev.Raw) {
			// Not text at all (compressed bytes without their
			// Content-Encoding, say): no cut another engine may not
			// repeat.
			err = fmt.Errorf("%w: not an event stream", errUnsafeAnswer)
		}
	}
	if err != nil {
		o.release()
		if errors.Is(err, io.EOF) {
			err = ErrStreamCut
		}
		return &UpstreamError{Phase: PhaseDecode, Endpoint: o.ep.url, Status: resp.StatusCode, Err: err}
	}
	o.pending, o.hasPending = ev, true
	// The Response releases the render answer once its capture has seen
	// the first data event.
	bufs.renderInStream = o.renderText
	return nil
}

func isEventStream(ct string) bool {
	switch ct {
	case "text/event-stream", "text/event-stream; charset=utf-8":
		return true // what engines send, without ParseMediaType's map
	}
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "text/event-stream"
}

// clientSafe returns an engine's error body as it may reach a client: a
// JSON body that names no handle member anywhere, not even in a string
// (vLLM's validation errors echo the request, handle included), and that
// sse.Scrub lets through; nil otherwise, and the client gets the router's
// own error for the status. Handles never leave the router.
func clientSafe(b []byte) []byte {
	if sse.MayHoldHandle(b) {
		return nil
	}
	out, _, err := sse.Scrub(nil, b)
	if err != nil {
		return nil
	}
	return out
}

// identityEncoded reports whether a response's body is sent as it is: no
// Content-Encoding, or only identity. The router never asks engines for
// compressed answers (transport.RequestHeader drops the client's
// Accept-Encoding) and cannot inspect compressed bytes, so any other
// encoding fails closed.
func identityEncoded(h http.Header) bool {
	for _, v := range h.Values("Content-Encoding") {
		for tok := range strings.SplitSeq(v, ",") {
			if tok = strings.TrimSpace(tok); tok != "" && !strings.EqualFold(tok, "identity") {
				return false
			}
		}
	}
	return true
}

// dropUnsafeHeaders removes from an engine's response headers, before they
// reach a client (transport.CopyHeader has dropped the hop-by-hop ones),
// Server and Date (the engine's software and clock: the server that
// answers the client sets its own), Content-Encoding (only identity is
// accepted, and the body may be rewritten) and every header whose name or
// value names kv_transfer_params or a handle member, or whose value holds
// a \u escape. It is the one place an engine's headers become a
// Response's.
func dropUnsafeHeaders(h http.Header) {
	for k, vs := range h {
		drop := k == "Content-Encoding" || k == "Server" || k == "Date" || headerNames(k, "kv_transfer") || headerNames(k, "remote_")
		for _, v := range vs {
			drop = drop || strings.Contains(v, kvKey) || strings.Contains(v, "remote_") || strings.Contains(v, `\u`)
		}
		if drop {
			delete(h, k)
		}
	}
}

// headerNames reports whether the header name k contains word (lower case,
// '_' for a word break), ignoring ASCII case and reading '-' as '_',
// without allocating.
func headerNames(k, word string) bool {
	for i := 0; i+len(word) <= len(k); i++ {
		j := 0
		for ; j < len(word); j++ {
			c := k[i+j]
			if c == '-' {
				c = '_'
			} else if 'A' <= c && c <= 'Z' {
				c += 'a' - 'A'
			}
			if c != word[j] {
				break
			}
		}
		if j == len(word) {
			return true
		}
	}
	return false
}
