package kvroute

import (
	"context"
	"io"
	"net/http"
	"sync"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/transport"
)

// Background renders. vLLM returns no token ids on /v1/responses and
// /v1/messages, so a turn there that was not rendered for verification (a
// first turn, a miss) is rendered to fingerprint the prompt its handle
// holds. That render is not needed for the turn's answer, so it starts
// beside the prefill leg, on the prefill engine, and is done long before
// the answer ends unless the renderer is slower than prefill and decode
// together. Then the turn's retention, which runs before the last event of
// a stream (so that a client's next turn finds the handle), waits for it,
// within WithTimeouts' Render: a renderer that fails or hangs opens its
// breaker, after which turns skip the render (and are not retained) and
// the breaker's one trial call is never waited for: the handle is
// retained when it answers, after the turn has ended.

// bgRender is one turn's background render.
type bgRender struct {
	trial  bool          // the render breaker's trial call: never waited for
	answer chan struct{} // closed when the render has answered
	mu     sync.Mutex
	done   bool
	ids    []uint32
	err    error
	then   func(ids []uint32, err error) // set when the turn's retention waits for it
	cancel context.CancelFunc
}

// beside starts the render of the turn's prompt on ep, the prefill engine
// of its first prefill attempt, when the turn will need it to seal: an API
// without token ids, not already rendered. It is bounded by
// WithTimeouts' Render and stopped by Close; an open render breaker on ep
// skips it (the turn is then not retained, Stats.RenderSkipped).
func (p *tokenProof) beside(ep *endpoint) {
	t := p.t
	r := t.r
	if p.bg != nil || t.bufs.rendered != nil || !r.cfg.reuse || t.req.api.tokenIDs {
		return
	}
	path, list := t.req.api.render, t.req.api.renderList
	if path == "" || list || !r.renders.caps.available(ep.url, path, r.cfg.clock()) {
		return
	}
	if r.renders.caps.skip(ep.url, r.cfg.clock()) {
		r.stats.renderSkipped.Add(1)
		return
	}
	ok, trial := r.renders.caps.claim(ep.url, r.cfg.clock())
	if !ok {
		r.stats.renderSkipped.Add(1)
		return
	}
	// Everything the goroutine reads of the turn is built here: the
	// body's pieces, with a reference to the pooled client body they
	// alias that the goroutine owns (taken here, before it starts: the
	// turn may end first) and releases when it ends, and the shared leg
	// headers.
	ref := t.req.ref
	if !ref.hold() {
		return
	}
	body := t.req.obj.EditPieces(make(legBody, 0, 8), renderDrop)
	h := t.legs.header().Clone()
	h.Set(headerRequestID, t.id+"-render")
	ep.ep.ApplyHeader(h)
	ctx, cancel := context.WithTimeout(r.renders.bgCtx, r.cfg.renderTimeout)
	bg := &bgRender{cancel: cancel, trial: trial, answer: make(chan struct{})}
	p.bg = bg
	r.renders.bgWG.Add(1)
	go func() {
		defer r.renders.bgWG.Done()
		defer ref.release()
		defer cancel()
		r.stats.renders.Add(1)
		ids, status, err := r.renders.detached(ctx, ep, path, body, ref, h)
		r.renders.result(ctx, ep.url, status, err)
		switch {
		case err == nil:
			r.renders.caps.served(ep.url, path)
		case routeMissing(status):
			r.renders.caps.markMissing(ep.url, path, status, r.cfg.clock())
		}
		bg.mu.Lock()
		bg.done, bg.ids, bg.err = true, ids, err
		then := bg.then
		bg.mu.Unlock()
		close(bg.answer)
		if then != nil {
			then(ids, err)
		}
	}()
}

// result returns the render's answer (done true): at once when it has
// come, after waiting for it when the render is not a breaker trial (it
// ends within WithTimeouts' Render). A trial's pending answer is handed to
// then instead, which runs when it comes.
func (b *bgRender) result(then func([]uint32, error)) (ids []uint32, err error, done bool) {
	if !b.trial {
		<-b.answer
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.done {
		return b.ids, b.err, true
	}
	b.then = then
	return nil, nil, false
}

// abandon stops the render unless the turn's retention waits for it.
func (b *bgRender) abandon() {
	b.mu.Lock()
	waited := b.then != nil
	b.mu.Unlock()
	if !waited {
		b.cancel()
	}
}

// detached posts body to path on ep with headers h, outside any
// turn's state (no trace span: it runs beside the turn), and returns the
// token_ids of the answer and the engine's status. The caller holds a
// reference to ref until it returns.
func (r *renderers) detached(ctx context.Context, ep *endpoint, path string, body legBody, ref *bodyRef, h http.Header) ([]uint32, int, error) {
	u, err := ep.pathURL(path)
	if err != nil {
		return nil, 0, err
	}
	rd, err := body.reader(ref)
	if err != nil {
		return nil, 0, err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, "", rd)
	if err != nil {
		_ = rd.Close()
		return nil, 0, err
	}
	*hreq.URL = *u
	hreq.Host = u.Host
	hreq.Header = h
	hreq.ContentLength = int64(body.size())
	hreq.GetBody = func() (io.ReadCloser, error) { return body.reader(ref) }
	resp, err := r.client.send(hreq, PhaseVerify, ep, transport.Deadlines{})
	if err != nil {
		return nil, upstream.Answered(err), err
	}
	defer resp.Body.Close()
	b, err := readSized(resp.Body, resp.ContentLength, r.maxBody, nil)
	if err != nil {
		return nil, resp.StatusCode, &UpstreamError{Phase: PhaseVerify, Endpoint: ep.url, Status: resp.StatusCode, Err: err}
	}
	obj, err := jsonraw.Parse(b)
	if err != nil {
		return nil, resp.StatusCode, &UpstreamError{Phase: PhaseVerify, Endpoint: ep.url, Status: resp.StatusCode, Err: errRenderShape}
	}
	v, _ := obj.Get("token_ids")
	ids, ok := capture.AppendTokenIDs(nil, v)
	if !ok {
		return nil, resp.StatusCode, &UpstreamError{Phase: PhaseVerify, Endpoint: ep.url, Status: resp.StatusCode, Err: errRenderShape}
	}
	return ids, resp.StatusCode, nil
}
