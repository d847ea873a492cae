package kvroute

import (
	"bytes"
	"context"
	"errors"
	"net/http"

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
// breaker is open are not asked (renderer.go).
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
