package kvroute

import (
	"context"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strings"
	"unicode/utf8"

	"github.com/bidikv/bidikv/sse"
	"github.com/bidikv/bidikv/transport"
)

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
		ep.mem.Live.Add(-live)
		return nil, err
	}
	t.rec.FirstByte = r.cfg.clock().Sub(sent)
	out := &Response{StatusCode: resp.StatusCode, Header: http.Header{}, t: t, ep: ep, live: live, body: resp.Body,
		sent: sent, added: leg.added, asked: leg.asked}
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
