package kvroute

import (
	"context"
	"errors"
	"log/slog"

	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
	"github.com/bidikv/bidikv/threshold"
)

// tokenProof is VerifyTokens: the new prompt, rendered by a prefill engine
// exactly as generation would (render.go), is compared block by block with
// the fingerprint of what the handle's blocks hold; only the verified
// prefix is attached. D's answer carries its token ids (return_token_ids),
// from which seal fingerprints the new handle; on APIs whose engines return
// none, the rendered prompt is fingerprinted instead, rendered beside the
// prefill leg when verification did not (bgrender.go). A handle without a
// fingerprint, or a prompt that could not be rendered, falls back to
// content rules.
type tokenProof struct {
	t         *turn
	content   contentProof
	byContent bool               // this turn's candidate is checked by content rules
	tokens    []uint32           // the prompt's tokens, once obtained
	renderer  *endpoint          // the prefill engine that rendered them
	avoid     []string           // prefill engines the conversation avoids: they do not render it
	prefix    fingerprint.Prefix // the chain over the verified prefix (its ids alias tokens)
	bg        *bgRender          // the background render, for APIs without token ids
}

func newTokenProof(t *turn) proof { return &tokenProof{t: t, content: contentProof{t}} }

// prepare obtains the prompt's tokens for a handle with a fingerprint,
// unless no verified prefix could pay for the render call.
func (p *tokenProof) prepare(ctx context.Context, f *found) MissReason {
	t := p.t
	r := t.r
	p.avoid = f.avoid
	if f.e.FP == nil {
		p.byContent = true
		return ""
	}
	t.rec.Verification = VerifyTokens
	// Skip the render call when no verified prefix could pay.
	if !r.policy.Reuse(threshold.Input{RemoteTokens: f.e.Tokens}) {
		return MissThreshold
	}
	toks, err := p.promptTokens(ctx)
	if err != nil {
		p.fallBack(ctx, err)
		return ""
	}
	p.tokens = toks
	t.rec.PromptTokens = len(toks)
	return ""
}

// fallBack counts and logs (once) a prompt that could not be rendered: the
// candidate is checked by content rules instead.
func (p *tokenProof) fallBack(ctx context.Context, err error) {
	t := p.t
	r := t.r
	p.byContent = true
	switch {
	case errors.Is(err, errNoRenderer):
		r.stats.tokenFallbacks.Add(1)
		if t.req.api.render != "" {
			t.lacks(missingRenderRoute)
		}
		r.log.once(ctx, "no_renderer", "kvroute: no engine serves /v1/chat/completions/render, /v1/completions/render or /tokenize for this request; reuse falls back to content verification (see WithVerification)")
	case errors.Is(err, errRenderSkipped):
		// Counted in Stats.RenderSkipped; the breaker or the distrust
		// logged why.
	default:
		r.stats.renderFailures.Add(1)
		var ue *UpstreamError
		errors.As(err, &ue)
		ep := ""
		if ue != nil {
			ep = ue.Endpoint
		}
		r.log.once(ctx, "render_failed:"+ep, "kvroute: a render call failed; such turns are verified by content instead (Stats.RenderFailures)",
			slog.String("request_id", t.id), slog.String("err", err.Error()))
	}
}

// check compares the prompt's tokens with the handle's fingerprint.
func (p *tokenProof) check(f *found) (verified, MissReason) {
	if p.byContent {
		return p.content.check(f)
	}
	t := p.t
	counted := verified{prompt: len(p.tokens)} // a miss's: the prompt's tokens, for the decode leg's live tokens
	cp, err := f.e.FP.VerifyPrefix(p.tokens)
	if err != nil {
		return counted, MissBadEntry
	}
	n := cp.Tokens()
	// The chain over the verified tokens, for this turn's own fingerprint
	// (D's blocks begin with the same prompt).
	p.prefix = cp
	t.rec.VerifiedTokens = n
	if n == 0 {
		return counted, MissMismatch
	}
	return verified{tokens: n, matched: n, prompt: len(p.tokens), ids: p.tokens, renderer: p.renderer}, ""
}

// decodeIDs: the decode leg asks for token ids on the APIs that return
// them.
func (p *tokenProof) decodeIDs() bool { return p.t.r.cfg.reuse && p.t.req.api.tokenIDs }

// end stops a background render nobody waits for and drops the verified
// chain, whose ids the turn's buffers return.
func (p *tokenProof) end() {
	if p.bg != nil {
		p.bg.abandon()
	}
	p.prefix = fingerprint.Prefix{}
}

// seal fingerprints the first tokens positions of D's blocks: D's prompt
// and generated ids, or on an API without token ids the prompt as the
// engines render it (D's blocks hold it first; the reply's tokens stay
// unverified and are never reused). The verified prefix is hashed again
// only when D's prompt ids differ from the rendered ones there.
func (p *tokenProof) seal(tokens int, ids tokenIDs) (fingerprint.Fingerprint, wait) {
	t := p.t
	r := t.r
	bs := ids.blockSize
	if bs <= 0 {
		bs = defaultBlockSize
	}
	if !t.req.api.tokenIDs {
		if p.bg != nil && t.bufs.rendered == nil {
			return nil, p.waitRender(tokens, bs)
		}
		if tokens > 0 {
			rendered := t.bufs.rendered
			if len(rendered) == 0 {
				noRender(r, t.req.Path)
				if r.renders.caps.missingAny(ids.prefill, t.req.api.render) {
					t.lacks(missingRenderRoute)
				}
				return nil, nil
			}
			n := min(len(rendered), tokens)
			return fingerprint.AppendFrom(t.bufs.fingerprint(n, bs), p.prefix, rendered, nil, n, bs), nil
		}
	}
	if !ids.ok || tokens <= 0 {
		r.stats.tokenFallbacks.Add(1)
		if !ids.ok {
			t.lacks(missingTokenIDs)
		}
		r.log.once(context.Background(), "no_token_ids", "kvroute: the decode engine sent no token ids (return_token_ids); such turns are retained under content rules only (see WithVerification)")
		return nil, nil
	}
	fp := fingerprint.AppendFrom(t.bufs.fingerprint(tokens, bs), p.prefix, ids.prompt, ids.generated, tokens, bs)
	if fp == nil {
		r.log.once(context.Background(), "token_count", "kvroute: the decode engine's token ids are fewer than its handle's remote_num_tokens; such turns are retained under content rules only")
	}
	return fp, nil
}

// noRender counts and logs (once per path) a prompt no engine rendered: its
// turn cannot be verified by tokens.
func noRender(r *Router, path string) {
	r.stats.tokenFallbacks.Add(1)
	r.log.once(context.Background(), "no_render:"+path, "kvroute: no engine renders "+path+" prompts; such turns cannot be verified by tokens and are not reused",
		slog.String("path", path))
}

// waitRender is seal's wait for the background render: the fingerprint of
// the rendered prompt once it has answered (at once, or after waiting for
// it within WithTimeouts' Render), or, for a render breaker's trial that has
// not answered, when it answers, after the turn.
func (p *tokenProof) waitRender(tokens, bs int) wait {
	// What the render's answer is sealed with, which may be after the
	// turn: nothing of the turn's own state.
	bg, r, path := p.bg, p.t.r, p.t.req.Path
	return func(store func(fingerprint.Fingerprint) (Refusal, bool)) (Refusal, bool, bool) {
		seal := func(ids []uint32, err error) (Refusal, bool) {
			if err != nil || len(ids) == 0 {
				// store(nil): nothing to seal, the handle is not kept
				// (RefuseUnrendered), and its hold is released.
				noRender(r, path)
				return store(nil)
			}
			n := min(len(ids), tokens)
			fp := fingerprint.AppendFrom(r.bufs.bytes.Get(fingerprint.Size(n, bs)), fingerprint.Prefix{}, ids, nil, n, bs)
			defer r.bufs.bytes.Put(fp)
			return store(fp)
		}
		ids, err, done := bg.result(func(ids []uint32, err error) { seal(ids, err) })
		if !done {
			return RefuseRenderPending, false, true
		}
		refusal, stored := seal(ids, err)
		return refusal, stored, false
	}
}
