package kvroute

import (
	"context"
	"errors"
	"net"

	"github.com/bidikv/bidikv/internal/jsonraw"
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
	resp, err := send(ctx, t, ep, newDecodeLeg(t.req, nil, t.askIDs(), nil), prefilled{reuse: ReuseLocal, prompt: w.prompt})
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
