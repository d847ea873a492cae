package kvroute

import (
	"context"
	"errors"
	"io"
	"mime"
	"net/http"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
	"github.com/bidikv/bidikv/transport"
)

// decodeBody is message 4: the client's body with P's handle, or with no
// kv_transfer_params at all when P gave none (the local fallback). The
// miss handle never reaches a decode engine.
func (t *turn) decodeBody(pHandle []byte) []byte {
	if pHandle == nil {
		return t.req.obj.Edit(decodeDrop)
	}
	return t.req.obj.Edit(decodeDrop, jsonraw.Member{Key: kvKey, Value: pHandle})
}

// runDecode sends the decode leg at once and wraps D's answer.
func (t *turn) runDecode(ctx context.Context, pHandle []byte, _ string, ent *entry) (*Response, error) {
	affinity := ""
	if ent != nil && t.rec.Reuse == ReuseHit {
		affinity = ent.endpoint
	}
	ep, err := t.r.decode.pick(ctx, t.r.selector, t.req, affinity, nil)
	if err != nil {
		return nil, err
	}
	t.rec.DecodeEndpoint = ep.url
	dctx, cancel := context.WithCancel(ctx)
	hreq, err := t.upstreamRequest(dctx, ep, t.decodeBody(pHandle))
	if err != nil {
		cancel()
		return nil, err
	}
	ep.inflight.Add(1)
	sent := t.r.cfg.clock()
	resp, err := t.r.client.Do(hreq, transport.Deadlines{FirstByte: t.r.cfg.firstByteTimeout, Idle: t.r.cfg.idleTimeout})
	if err != nil {
		ep.inflight.Add(-1)
		cancel()
		return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: ep.url, Err: err}
	}
	t.rec.FirstByte = t.r.cfg.clock().Sub(sent)
	out := &Response{StatusCode: resp.StatusCode, Header: http.Header{}, t: t, ep: ep, body: resp.Body, cancel: cancel}
	transport.CopyHeader(out.Header, resp.Header)
	out.Header.Set(headerRequestID, t.id)
	out.Header.Set(headerReuse, t.rec.Reuse)
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		out.release()
		return nil, &UpstreamError{Phase: PhaseDecode, Endpoint: ep.url, Status: resp.StatusCode, Body: stripHandle(b), Err: errors.New(http.StatusText(resp.StatusCode))}
	}
	if isEventStream(resp.Header.Get("Content-Type")) {
		out.stream = true
		out.Header.Del("Content-Length")
		out.reader = sse.NewReader(resp.Body)
		out.capture = &capture{chat: t.req.Chat()}
		return out, nil
	}
	if err := out.readBody(); err != nil {
		return nil, err
	}
	return out, nil
}

func isEventStream(ct string) bool {
	mt, _, err := mime.ParseMediaType(ct)
	return err == nil && mt == "text/event-stream"
}

// stripHandle removes a top-level kv_transfer_params from a JSON object
// body; anything else is returned as is.
func stripHandle(b []byte) []byte {
	obj, err := jsonraw.Parse(b)
	if err != nil || !obj.Has(kvKey) {
		return b
	}
	return obj.Edit([]string{kvKey})
}
