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
	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/sse"
	"github.com/bidikv/bidikv/transport"
)

// decodeBody is message 4: the client's body with P's handle, or with no
// kv_transfer_params at all when P gave none (the local fallback). The
// miss handle never reaches a decode engine.
// In token mode it also asks D for token ids (return_token_ids), unless the
// client asked for them itself.
func (t *turn) decodeBody(pHandle []byte) legBody {
	set := make([]jsonraw.Member, 0, 2)
	if pHandle != nil {
		set = append(set, jsonraw.Member{Key: kvKey, Value: pHandle})
	}
	if t.r.cfg.reuse && t.r.cfg.verification == VerifyTokens && t.req.api.tokenIDs() {
		if v, ok := t.req.Field("return_token_ids"); ok {
			t.idsAsked, _ = lenientBool(v)
		}
		if !t.idsAsked {
			t.idsAdded = true
			set = append(set, jsonraw.Member{Key: "return_token_ids", Value: jsonTrue})
		}
	} else if v, ok := t.req.Field("return_token_ids"); ok {
		t.idsAsked, _ = lenientBool(v)
	}
	return t.req.obj.EditPieces(make(legBody, 0, 24), decodeDrop, set...)
}

// errLeaseExpired means P's lease on its blocks had less than ExpiryGuard
// left when the decode leg was to be sent: D could read freed blocks.
var errLeaseExpired = errors.New("kvroute: the prefill engine's lease ran out before the decode leg")

// runDecode sends the decode leg and wraps D's answer. While nothing has
// reached the caller, a leg that failed before any connection was made (so
// no engine can have read P's handle) is sent again, with the same handle,
// to another decode engine, as long as P's lease still has ExpiryGuard
// left. Any other failure is returned; Do decides whether to redo the turn.
func (t *turn) runDecode(ctx context.Context, pHandle []byte, _ string, ent *entry.Entry) (*Response, error) {
	affinity := ""
	if ent != nil && t.hit {
		affinity = ent.Endpoint
	}
	body := t.decodeBody(pHandle)
	var last error
	for {
		if t.decodeLegs >= t.r.cfg.decodeAttempts {
			return nil, last
		}
		ep, err := t.r.decode.pick(ctx, t.r.selector, t.req, affinity, t.hint, t.avoidD)
		if errors.Is(err, ErrNoEndpoint) && len(t.avoidD) > 0 {
			t.avoidD = t.avoidD[:0] // every engine failed once: try them again
			ep, err = t.r.decode.pick(ctx, t.r.selector, t.req, affinity, t.hint, t.avoidD)
		}
		if err != nil {
			if last != nil {
				return nil, last
			}
			return nil, err
		}
		t.decodeLegs++
		if pHandle != nil && t.r.cfg.clock().Sub(t.pDone) > t.r.cfg.lease-ExpiryGuard {
			return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: t.rec.PrefillEndpoint, Err: errLeaseExpired}
		}
		dctx := t.startDecode(ctx, ep.url)
		resp, err := t.decodeOnce(dctx, ep, body)
		t.decodeDone(dctx, resp, err)
		if err == nil {
			return resp, nil
		}
		if ctx.Err() != nil {
			return nil, err
		}
		if unhealthy(err, false) {
			t.r.hp.failed(ep, err)
		}
		t.avoidD = append(t.avoidD, ep.url)
		if !redoable(err) || (pHandle != nil && !unsent(err)) || !t.againAfter(err) {
			return nil, err
		}
		last = err
		affinity = ""
	}
}

// redo reports whether a turn whose decode leg failed with err may run
// again as a plain miss: nothing reached the caller (Do has not returned),
// the failure is one another engine may not repeat, decode legs are left,
// and after a timeout another engine may answer (againAfter).
func (t *turn) redo(ctx context.Context, err error) bool {
	return ctx.Err() == nil && redoable(err) && t.decodeLegs < t.r.cfg.decodeAttempts && !t.r.closed.Load() &&
		t.againAfter(err)
}

// againAfter reports whether another decode leg may follow one that failed
// with err. A leg that timed out (no headers within WithFirstByteTimeout,
// or no first event within WithIdleTimeout) cost the whole timeout, and
// the engine may be stalled for every request: another leg, with another
// prefill, follows only for an engine this turn has not tried that is
// healthy now, and only after the turn's first timeout. So a turn waits
// for silent decode engines at most twice the timeout, and never sends
// the same silent engine a new prefill's handle.
func (t *turn) againAfter(err error) bool {
	if !timedOut(err) {
		return true
	}
	t.decodeTimeouts++
	return t.decodeTimeouts == 1 && t.r.decode.hasOther(t.avoidD)
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
	case errors.Is(err, errUnsafeAnswer):
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

// decodeOnce sends one decode leg to ep. A stream's first event is read
// before it returns, so that a stream that breaks at once can still be
// retried: nothing has reached the caller yet.
func (t *turn) decodeOnce(ctx context.Context, ep *endpoint, body legBody) (*Response, error) {
	t.decodeURL = ep.url
	t.rec.DecodeEndpoint = ep.url
	// No context of its own: closing the body transport.Client.Do
	// returns (Response.release) cancels the exchange's context.
	hreq, err := t.upstreamRequest(ctx, PhaseDecode, ep, body)
	if err != nil {
		return nil, err
	}
	ep.inflight.Add(1)
	sent := t.r.cfg.clock()
	t.dSent = sent
	resp, err := t.r.client.Do(hreq, transport.Deadlines{FirstByte: t.r.cfg.firstByteTimeout, Idle: t.r.cfg.idleTimeout})
	if err != nil {
		ep.inflight.Add(-1)
		return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: ep.url, Err: err}
	}
	t.rec.FirstByte = t.r.cfg.clock().Sub(sent)
	out := &Response{StatusCode: resp.StatusCode, Header: http.Header{}, t: t, ep: ep, body: resp.Body}
	transport.CopyHeader(out.Header, resp.Header)
	dropUnsafeHeaders(out.Header)
	// The router's two headers in one backing array (canonical names).
	own := []string{t.id, string(t.rec.Reuse)}
	out.Header[headerRequestID] = own[0:1:1]
	out.Header[headerReuse] = own[1:2:2]
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		out.release()
		return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: ep.url, Status: resp.StatusCode, Body: clientSafe(b), Err: errors.New(http.StatusText(resp.StatusCode))}
	}
	if !identityEncoded(resp.Header) {
		out.release()
		return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: ep.url, Status: resp.StatusCode,
			Err: fmt.Errorf("%w: it is compressed (a Content-Encoding other than identity)", errUnsafeAnswer)}
	}
	if isEventStream(resp.Header.Get("Content-Type")) {
		out.stream = true
		out.Header.Del("Content-Length")
		// A pooled buffer as large as the last stream needed (D's first
		// chunk carries the prompt's ids in token mode); Next returns it
		// at the stream's end.
		out.reader = sse.NewReader(resp.Body, t.r.maxEvent,
			sse.WithBuffer(t.r.bufs.Get(max(int(t.r.streamBuf.Load()), bufpool.MinPooled))))
		out.capture = t.req.api.newStream(t.idsAdded || t.idsAsked, t.idsAdded)
		if ib, ok := out.capture.(interface{ UseIDBuffer([]uint32) }); ok && (t.idsAdded || t.idsAsked) {
			// The prompt's ids go into a pooled slice as large as the last
			// prompt's, returned when the turn ends.
			t.streamIDs = t.r.ids.Get(int(t.r.promptIDs.Load()))
			ib.UseIDBuffer(t.streamIDs)
		}
		if hc, ok := out.capture.(interface{ UseHandleBuffer([]byte) }); ok {
			// D's handle goes into a pooled buffer as large as the last
			// one, returned once the handle is retained.
			hc.UseHandleBuffer(t.r.bufs.Get(max(int(t.r.handleBuf.Load()), bufpool.MinPooled)))
		}
		if ec, ok := out.capture.(interface{ ExpectPromptIDs([]byte, []uint32) }); ok && (t.idsAdded || t.idsAsked) && t.renderText != nil && t.rendered != nil {
			// D's prompt ids, when spelled as the render answer's, are
			// the rendered ones: not parsed again.
			ec.ExpectPromptIDs(t.renderText, t.rendered)
			out.renderText = true
		}
		ev, err := out.reader.Next()
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
			out.release()
			if errors.Is(err, io.EOF) {
				err = ErrStreamCut
			}
			return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: ep.url, Status: resp.StatusCode, Err: err}
		}
		out.pending, out.hasPending = ev, true
		// The Response releases the render answer once its capture has
		// seen the first data event.
		t.renderInStream = out.renderText
		t.r.hp.succeeded(ep)
		return out, nil
	}
	if err := out.readBody(); err != nil {
		return nil, err
	}
	t.r.hp.succeeded(ep)
	return out, nil
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
// reach a client, Content-Encoding (only identity is accepted, and the
// body may be rewritten) and every header whose name or value names
// kv_transfer_params or a handle member, or whose value holds a \u escape.
func dropUnsafeHeaders(h http.Header) {
	for k, vs := range h {
		drop := k == "Content-Encoding" || headerNames(k, "kv_transfer") || headerNames(k, "remote_")
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
