package kvroute

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
	"github.com/bidikv/bidikv/threshold"
	"github.com/bidikv/bidikv/transport"
	"github.com/cenkalti/backoff/v4"
)

// tokenProof is VerifyTokens: the new prompt, rendered by a prefill engine
// exactly as generation would (render.go), is compared block by block with
// the fingerprint of what the handle's blocks hold; only the verified
// prefix is attached. D's answer carries its token ids (return_token_ids),
// from which seal fingerprints the new handle; on APIs whose engines return
// none, the rendered prompt is fingerprinted instead, rendered beside the
// prefill leg when verification did not (render.go). A handle without a
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

// What the router knows of each prefill engine's renderer (its render
// routes and /tokenize): the paths it does not serve, whether its renders
// can be trusted, and a circuit breaker over its failures. A render is only
// worth its round trip when it answers quickly and says what the engine
// will compute; an engine whose renderer fails, hangs or disagrees with its
// own prefill is not asked again for a while, and its turns go on without
// a render (verified by content rules, or run as plain prefills).

// renderRetry is how long an engine that answered a render path with 404 or
// 501 is not asked on that path again.
const renderRetry = 5 * time.Minute

// renderDistrust is how long an engine whose prefill computed other prompt
// tokens than its render answered is not asked to render.
const renderDistrust = 5 * time.Minute

// The render circuit breaker: renderBreakerFailures consecutive failures
// (connection errors, 5xx, 429, answers without token ids), or one call
// that ran out of WithTimeouts' Render, open it for renderBreakerFirst,
// doubling with each failed trial up to renderBreakerMax. When the time is
// up, one turn tries the renderer again (the others skip it meanwhile); a
// success closes the breaker.
const (
	renderBreakerFailures = 3
	renderBreakerFirst    = 5 * time.Second
	renderBreakerMax      = 5 * time.Minute
)

// errRenderSkipped: every prefill engine's renderer is distrusted or its
// breaker is open; the turn goes on without a render.
var errRenderSkipped = errors.New("kvroute: every prefill engine's renderer is failing or distrusted; the turn is not rendered")

// renderers is what the Router knows of the prefill engines' renderers and
// the render calls it makes beside turns (render.go), which Close ends.
type renderers struct {
	caps    renderCaps
	prefill *pool
	client  engineClient
	clock   func() time.Time
	maxBody int64 // WithLimits' Body: a render answer's bound
	stats   *counters
	log     *logger
	// bgCtx ends the background renders when the Router closes; bgWG
	// waits for them.
	bgCtx    context.Context
	bgCancel context.CancelFunc
	bgWG     sync.WaitGroup
}

// close stops the background renders and waits for them.
func (r *renderers) close() error {
	r.bgCancel()
	r.bgWG.Wait()
	return nil
}

// renderCaps is the renderer state of the prefill engines, by URL.
type renderCaps struct {
	mu       sync.Mutex
	missing  map[string]missingRoute // URL + " " + path
	distrust map[string]time.Time    // URL -> until
	breakers map[string]*renderBreaker
}

// missingRoute is a path an engine answered 404 or 501 (status): it is
// not asked there again until retry, and is reported missing
// (Router.Endpoints) until it answers.
type missingRoute struct {
	retry  time.Time
	status int
}

// renderBreaker is one engine's render circuit breaker.
type renderBreaker struct {
	fails   int
	open    bool
	until   time.Time // an open breaker lets one trial through after this
	probing bool      // the trial call is in flight
	bo      *backoff.ExponentialBackOff
}

func (c *renderCaps) available(ep, path string, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	m, ok := c.missing[ep+" "+path]
	return !ok || now.After(m.retry)
}

// markMissing records that ep answered path with status (404 or 501).
func (c *renderCaps) markMissing(ep, path string, status int, now time.Time) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.missing == nil {
		c.missing = map[string]missingRoute{}
	}
	c.missing[ep+" "+path] = missingRoute{retry: now.Add(renderRetry), status: status}
}

// served records that ep answered path: it is no longer missing.
func (c *renderCaps) served(ep, path string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.missing, ep+" "+path)
}

// missingOn returns the paths ep was last found not to serve, with the
// status it answered.
func (c *renderCaps) missingOn(ep string) map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	var out map[string]int
	for k, m := range c.missing {
		if p, ok := strings.CutPrefix(k, ep+" "); ok {
			if out == nil {
				out = map[string]int{}
			}
			out[p] = m.status
		}
	}
	return out
}

// missingAny reports whether ep was last found not to serve path.
func (c *renderCaps) missingAny(ep, path string) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	_, ok := c.missing[ep+" "+path]
	return ok
}

// skip reports whether a render call to ep must not be made now: its
// renders are distrusted, or its breaker is open (a trial already in
// flight, or not yet due).
func (c *renderCaps) skip(ep string, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if until, ok := c.distrust[ep]; ok && now.Before(until) {
		return true
	}
	b := c.breakers[ep]
	return b != nil && b.open && (b.probing || now.Before(b.until))
}

// claim marks the call about to be made to ep: for an open breaker whose
// time is up, the one trial call (trial true). It reports false when
// another turn claimed the trial first.
func (c *renderCaps) claim(ep string, now time.Time) (ok, trial bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	b := c.breakers[ep]
	if b == nil || !b.open {
		return true, false
	}
	if b.probing || now.Before(b.until) {
		return false, false
	}
	b.probing = true
	return true, true
}

// succeeded closes ep's breaker.
func (c *renderCaps) succeeded(ep string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.breakers, ep)
}

// failed counts a failed render call to ep and reports whether it opened
// the breaker (or kept it open after a failed trial).
func (c *renderCaps) failed(ep string, timedOut bool, now time.Time) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.breakers == nil {
		c.breakers = map[string]*renderBreaker{}
	}
	b := c.breakers[ep]
	if b == nil {
		b = &renderBreaker{}
		c.breakers[ep] = b
	}
	b.fails++
	b.probing = false
	if !b.open && !timedOut && b.fails < renderBreakerFailures {
		return false
	}
	if b.bo == nil {
		b.bo = backoff.NewExponentialBackOff(
			backoff.WithInitialInterval(renderBreakerFirst),
			backoff.WithMaxInterval(renderBreakerMax),
			backoff.WithMaxElapsedTime(0),
			backoff.WithRandomizationFactor(0.2),
		)
	}
	b.open = true
	b.until = now.Add(b.bo.NextBackOff())
	return true
}

// distrustFor stops asking ep to render for d.
func (c *renderCaps) distrustFor(ep string, now time.Time, d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.distrust == nil {
		c.distrust = map[string]time.Time{}
	}
	c.distrust[ep] = now.Add(d)
}

// release ends a claimed call to ep that says nothing of its renderer's
// health (the route is missing, the request was refused, the client went
// away).
func (c *renderCaps) release(ep string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if b := c.breakers[ep]; b != nil {
		b.probing = false
	}
}

// result feeds the outcome of a render call to ep to its breaker: a
// success closes it; a failure counts, unless it is the request's (a 4xx
// other than 429, a missing route) or the caller's (its context ended);
// an opening is counted and logged (once per engine).
func (r *renderers) result(ctx context.Context, ep string, status int, err error) {
	switch {
	case err == nil:
		r.caps.succeeded(ep)
		return
	case ctx.Err() != nil && !errors.Is(err, context.DeadlineExceeded),
		status >= 400 && status < 500 && status != http.StatusTooManyRequests,
		routeMissing(status):
		r.caps.release(ep)
		return
	}
	timedOut := errors.Is(err, context.DeadlineExceeded) || errors.Is(err, transport.ErrTotalTimeout)
	if r.caps.failed(ep, timedOut, r.clock()) {
		r.stats.renderBreaks.Add(1)
		r.log.once(ctx, "render_breaker:"+ep, "kvroute: a prefill engine's renderer keeps failing; it is not asked to render for a while, and its turns go on without a render (Stats.RenderBreaks, Stats.RenderSkipped)",
			slog.String("endpoint", ep), slog.String("err", err.Error()))
	}
}

// skipped returns the prefill engines that must not be asked to render
// now, for the renderer pick to exclude.
func (r *renderers) skipped(now time.Time) []string {
	var out []string
	for _, e := range r.prefill.list() {
		if r.caps.skip(e.url, now) {
			out = append(out, e.url)
		}
	}
	return out
}
