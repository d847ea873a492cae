package kvroute

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/bidikv/bidikv/transport"
)

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
// the render calls it makes beside turns (bgrender.go), which Close ends.
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
