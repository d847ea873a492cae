package kvroute

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"sync"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/transport"
)

// Fields vLLM's /tokenize does not take (its request model is a reduced
// chat request): a request that sets one of them renders differently there
// than for generation, so /tokenize cannot verify it.
var tokenizeUnsupported = []string{"tool_choice", "documents", "reasoning_effort", "response_format"}

var (
	errNoRenderer  = errors.New("kvroute: no engine serves a render or tokenize endpoint for this request")
	errRenderShape = errors.New("kvroute: the render answer has no token ids")
)

// promptTokens returns the token ids the engines will compute for the
// request's prompt: from the body when a completions prompt is given as
// token ids, else from a prefill engine's render endpoint, else from its
// /tokenize when the request uses nothing /tokenize ignores.
func (p *tokenProof) promptTokens(ctx context.Context) ([]uint32, error) {
	t := p.t
	if t.bufs.rendered != nil {
		return t.bufs.rendered, nil
	}
	if pi, ok := t.req.api.impl.(promptIDer); ok {
		if ids, ok := pi.promptIDs(t.req); ok {
			t.rec.TokenSource = TokensFromPrompt
			return ids, nil
		}
	}
	// From the Router's pool (renderCall), held by the turn's buffers:
	// returned when the turn ends.
	return p.renderPrompt(ctx)
}

// renderPrompt asks a prefill engine for the prompt's tokens, and keeps
// that engine for the turn's prefill leg that carries a handle
// (verified.renderer, which the prefill phase uses): the tokens verified are the tokens
// that engine computes, even while engines of another version (a rolling
// upgrade) serve beside it. Engines whose renderer is distrusted or whose
// breaker is open are not asked (verify_tokens.go).
func (p *tokenProof) renderPrompt(ctx context.Context) ([]uint32, error) {
	t := p.t
	start := t.r.cfg.clock()
	defer func() { t.rec.Render += t.r.cfg.clock().Sub(start) }()
	ep, err := p.pickRenderer(ctx)
	if err != nil {
		return nil, err
	}
	ids, src, err := p.renderOn(ctx, ep)
	if err == nil {
		t.rec.TokenSource = src
		p.renderer = ep
	}
	return ids, err
}

// renderOn renders the prompt on ep: its render route, else /tokenize
// when the request uses nothing /tokenize ignores.
func (p *tokenProof) renderOn(ctx context.Context, ep *endpoint) ([]uint32, TokenSource, error) {
	t := p.t
	renderPath, list := t.req.api.render, t.req.api.renderList
	now := t.r.cfg.clock()
	if renderPath != "" && t.r.renders.caps.available(ep.url, renderPath, now) {
		// The client's bytes with the two members cut out, sent as pieces
		// (no copy of the body).
		body := t.req.obj.EditPieces(make(legBody, 0, 8), renderDrop)
		ids, status, err := p.renderCall(ctx, ep, renderPath, body, list)
		t.r.renders.result(ctx, ep.url, status, err)
		if err == nil {
			t.r.renders.caps.served(ep.url, renderPath)
			return ids, TokensFromRender, nil
		}
		if !routeMissing(status) {
			return nil, "", err
		}
		t.r.renders.caps.markMissing(ep.url, renderPath, status, now)
	}
	body, ok := tokenizeBody(t.req)
	if !ok || !t.r.renders.caps.available(ep.url, pathTokenize, now) {
		t.r.renders.caps.release(ep.url)
		return nil, "", errNoRenderer
	}
	ids, status, err := p.renderCall(ctx, ep, pathTokenize, legBody{body}, false)
	t.r.renders.result(ctx, ep.url, status, err)
	if err == nil {
		t.r.renders.caps.served(ep.url, pathTokenize)
		return ids, TokensFromTokenize, nil
	}
	if routeMissing(status) {
		t.r.renders.caps.markMissing(ep.url, pathTokenize, status, now)
		return nil, "", errNoRenderer
	}
	return nil, "", err
}

// pickRenderer picks the prefill engine to render on: one the Selector
// picks among those whose renderer is neither distrusted nor behind an
// open breaker (errRenderSkipped when none is left).
func (p *tokenProof) pickRenderer(ctx context.Context) (*endpoint, error) {
	t := p.t
	r := t.r
	now := r.cfg.clock()
	// Engines the conversation avoids (internal/distrust) neither render nor
	// prefill it.
	skipped := append(append(r.renders.skipped(now), p.avoid...), r.shapes.avoided(r.prefill)...)
	for range 3 {
		ep, err := r.prefill.pick(ctx, r.selector, t.req, "", t.req.hint, skipped)
		if errors.Is(err, ErrNoEndpoint) && len(skipped) > 0 {
			break
		}
		if err != nil {
			return nil, err
		}
		if ok, _ := r.renders.caps.claim(ep.url, now); ok {
			return ep, nil
		}
		// Another turn took the breaker's one trial call.
		skipped = append(skipped, ep.url)
	}
	r.stats.renderSkipped.Add(1)
	return nil, errRenderSkipped
}

const pathTokenize = "/tokenize"

// renderDrop are the members a render body leaves out of the client's
// request.
var renderDrop = []string{kvKey, "conversation_id"}

// routeMissing reports whether an engine's status says it does not serve
// the route at all (an older engine, or the renderer not enabled), as
// opposed to failing this one call.
func routeMissing(status int) bool {
	return status == http.StatusNotFound || status == http.StatusNotImplemented || status == http.StatusMethodNotAllowed
}

// tokenizeBody builds a /tokenize body from the request, or reports that
// /tokenize cannot render it as generation would.
func tokenizeBody(req *Request) ([]byte, bool) {
	tz, ok := req.api.impl.(tokenizer)
	if !ok || !tz.tokenizable(req) {
		return nil, false
	}
	fields := tz.tokenizeFields()
	for _, f := range tokenizeUnsupported {
		if v, ok := req.Field(f); ok && !jsonraw.IsNull(v) {
			return nil, false
		}
	}
	return pickMembers(req, fields), true
}

// renderCall posts body to path on ep and reads the token ids of the
// answer: token_ids of a render object (or of the single element of a
// completions render list), or tokens of a /tokenize answer. It returns the
// engine's status when it answered.
func (p *tokenProof) renderCall(ctx context.Context, ep *endpoint, path string, body legBody, list bool) (_ []uint32, _ int, err error) {
	t := p.t
	ctx, end := t.trace.phase(ctx, PhaseVerify, ep.url)
	defer func() { end(err) }()
	t.r.stats.renders.Add(1)
	// Its own request id: engines key requests by X-Request-Id, and the
	// prefill leg follows with the turn's.
	hreq, err := t.legs.requestTo(ctx, PhaseVerify, ep, path, body, t.legs.id+"-render")
	if err != nil {
		return nil, 0, err
	}
	resp, err := t.r.client.send(hreq, PhaseVerify, ep, transport.Deadlines{Total: t.r.cfg.renderTimeout})
	if err != nil {
		return nil, upstream.Answered(err), err
	}
	defer resp.Body.Close()
	// Read into a pooled buffer (the ids are copied out of it).
	var b []byte
	if l := resp.ContentLength; l > 0 && l <= t.r.cfg.maxBodyBytes {
		b, err = readExact(resp.Body, l, t.bufs.get)
	} else {
		b, err = t.r.bufs.bytes.Read(resp.Body, t.r.cfg.maxBodyBytes, int(t.r.bufs.render.Load()))
		if err == nil {
			hint(&t.r.bufs.render, cap(b))
		}
	}
	if err != nil {
		return nil, resp.StatusCode, &UpstreamError{Phase: PhaseVerify, Endpoint: ep.url, Status: resp.StatusCode, Err: err}
	}
	keep := false // the buffer is kept with the ids' text (holdRender)
	defer func() {
		if !keep {
			t.bufs.put(b)
		}
	}()
	obj := b
	if list {
		n := 0
		if jsonraw.Elements(b, func(v []byte) error { obj = v; n++; return nil }) != nil || n != 1 {
			return nil, resp.StatusCode, &UpstreamError{Phase: PhaseVerify, Endpoint: ep.url, Status: resp.StatusCode, Err: errRenderShape}
		}
	}
	key := "token_ids"
	if path == pathTokenize {
		key = "tokens"
	}
	// One pass validates the answer and converts its ids, into a pooled
	// slice with room for one id per comma.
	var o jsonraw.Object
	ids, m, err := o.ResetIDs(obj, key, t.r.bufs.ids.Get(bytes.Count(obj, []byte{','})+1))
	if err != nil {
		t.r.bufs.ids.Put(ids)
		return nil, resp.StatusCode, &UpstreamError{Phase: PhaseVerify, Endpoint: ep.url, Status: resp.StatusCode, Err: errRenderShape}
	}
	ok := m >= 0
	var text []byte
	if ok {
		_, text = o.Member(m)
		keep = true
	} else {
		// A duplicate or escaped key, or no id array: read the member
		// the way Get finds it.
		v, _ := o.Get(key)
		ids, ok = capture.AppendTokenIDs(ids[:0], v)
	}
	if !ok {
		t.r.bufs.ids.Put(ids)
		return nil, resp.StatusCode, &UpstreamError{Phase: PhaseVerify, Endpoint: ep.url, Status: resp.StatusCode, Err: errRenderShape}
	}
	if keep {
		t.bufs.holdRender(ids, b, text)
	} else {
		t.bufs.holdRender(ids, nil, nil)
	}
	return ids, resp.StatusCode, nil
}

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
