package kvroute

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/kvroute/internal/peertier"
	"github.com/bidikv/bidikv/transport"
)

// tries is what the turn's legs learned across its attempts, which a redo
// keeps: the engines to avoid, the decode legs started, and whether D
// prefills by itself. It is part of the turn's retainer, which Do owns;
// Do hands it to the prefill and decode phases, which add what they learn.
type tries struct {
	// avoidP are prefill engines of legs a redo abandoned; badP those the
	// turn must not use again: their prefill computed other prompt tokens
	// than the render said, after pulling the attached KV, which their
	// prefix cache may now hold under the tokens they computed (and those
	// the conversation avoids for that reason, internal/distrust).
	avoidP, badP []string
	avoidD       []string // decode engines that failed this turn
	decodeLegs   int      // decode legs started
	// decodeTimeouts counts the decode legs that timed out (againAfter).
	decodeTimeouts int
	// local: D prefills by itself (P gave no handle and the local
	// fallback is on, or only avoided prefill engines are left).
	local bool
}

// prefilled is the prefill phase's result: P's handle (nil when D prefills
// by itself), when P answered (its lease on the blocks runs from then),
// and whether the leg that succeeded carried the retained handle; what the
// decode leg tells the client of the turn's reuse (X-Bidikv-Reuse) and
// counts live of the prompt; the engine of the last attempt and how long
// the phase took, for the retain phase and the learning Chooser.
type prefilled struct {
	handle   []byte
	url      string // P's URL ("" when D prefills by itself)
	done     time.Time
	hit      bool
	reuse    ReuseOutcome  // ReuseHit when the leg that succeeded carried the retained handle, else ReuseMiss or ReuseOff
	prompt   int           // the prompt's tokens: P's count, else the way's (0: unknown)
	endpoint string        // the engine of the phase's last attempt (TurnRecord.PrefillEndpoint), "" when none
	took     time.Duration // the phase, from its first attempt to P's answer (TurnRecord.Prefill)
}

// prefill sends the prefill leg, retrying safe failures on other engines.
// The retained handle w.h, or the release handle w.rel (lookup.go), goes
// to the first attempt only: every retry is a plain miss, so a consumed
// handle is never resent. A leg whose engine
// computed other prompt tokens than it rendered is redone once as a plain
// miss, whatever the retry policy.
func prefill(ctx context.Context, t *turn, f *found, w way, tr *tries) (prefilled, error) {
	h := w.h
	p := prefiller{t: t, f: f, h: h, tries: tr, handle: kvhandle.Miss, peer: w.peer}
	if h.handle == nil && w.rel != nil {
		p.handle, p.releasing, p.why = w.rel, true, w.relWhy
	}
	if h.handle != nil {
		ph, err := kvhandle.ForHitKnown(h.handle, t.r.shapes.size(ctx, t.r.decode.find(f.e.Endpoint)), h.known)
		if err != nil {
			if errors.Is(err, kvhandle.ErrInvalid) {
				t.r.invalidHandle(PhaseLookup, f.e.Endpoint, err)
			}
			t.miss(MissBadEntry)
		} else {
			p.handle, p.attached = ph, true
		}
	}
	start := t.r.cfg.clock()
	p.tried = append(slices.Clone(tr.avoidP), tr.badP...) // a redone turn prefers a fresh engine
	attempt := func(int) (time.Duration, error) { return p.attempt(ctx) }
	err := transport.Retry(ctx, t.r.cfg.retry, attempt)
	if errors.Is(err, errRenderMismatch) || errors.Is(err, errReleaseFailed) {
		err = transport.Retry(ctx, t.r.cfg.retry, attempt)
	}
	if err != nil {
		return prefilled{}, err
	}
	done := t.r.cfg.clock()
	out := prefilled{done: done, reuse: ReuseMiss, prompt: w.prompt, endpoint: p.endpoint, took: done.Sub(start)}
	t.rec.Prefill = out.took
	switch {
	case p.attached:
		out.reuse = ReuseHit
	case !t.r.cfg.reuse:
		out.reuse = ReuseOff
	}
	if p.prompt > 0 {
		out.prompt = p.prompt
	}
	if tr.local {
		return out, nil
	}
	out.handle, out.url, out.hit = p.got, p.url, p.attached
	return out, nil
}

// Where a turn whose hold was released is prefilled. A hold released to
// make room or over the budget costs its conversation's next turn what
// the prefill engine serving that turn lacks in its prefix cache: little
// on the engine that prefilled the turn before, whose cache holds that
// prompt; the history since it last saw the conversation on any other.
// So, with the decode memory management on, the ledger records each
// retained turn's prefill engine with its key (shared by the Routers
// sharing the ledger: budget.Budget.SetPrefilled, in handles.retain), and
// a turn whose hold the ledger chose to release is prefilled there: the
// Selection.Affinity of its prefill leg (LeastLoaded passes it over at
// MaxInFlight). Turns whose hold expired, or that never had one, are
// placed as without the management.

// prefillFor is, with the management on, the prefill engine that served
// the turn whose hold, under one of keys, the ledger chose to release
// (budget.Budget.Prefilled): "" when there is none.
func prefillFor(m *decodeMemory, keys []string) string {
	if !m.cfg.on {
		return ""
	}
	now := m.clock()
	for _, k := range keys {
		if p := m.ledger.Prefilled(k, now); p != "" {
			return p
		}
	}
	return ""
}

// errReleaseFailed: the prefill attempt that carried a release handle
// failed; the leg is redone as a plain miss.
var errReleaseFailed = errors.New("kvroute: the prefill leg that released a hold failed")

// prefiller is one prefill phase: the handle its next attempt carries and
// the engines tried.
type prefiller struct {
	t        *turn
	f        *found
	h        hit
	tries    *tries
	handle   []byte // the retained handle, the release handle, or the miss handle
	attached bool   // handle is the retained one
	// releasing: handle releases a hold the turn does not attach (why).
	releasing bool
	why       releaseReason
	tried     []string
	got       []byte   // P's handle
	url       string   // the engine that gave it
	endpoint  string   // the engine of the last attempt
	prompt    int      // the prompt's tokens as the last of P's answers that counted them said (0: none did)
	peer      peerPull // the CPU tier an attempt without the retained handle pulls from (lookup.go, peerPath)
	peerTries int      // the attempts that named it, for their transaction ids
}

// attempt is one attempt of transport.Retry.
func (p *prefiller) attempt(ctx context.Context) (time.Duration, error) {
	t := p.t
	ep, err := p.pick(ctx)
	if ep == nil {
		return 0, err
	}
	t.rec.PrefillAttempts++
	t.rec.PrefillEndpoint = ep.url
	p.endpoint = ep.url
	attachedTokens := 0
	if p.attached {
		attachedTokens = p.h.v.tokens
	}
	if lh, ok := t.proof.(legHelper); ok {
		lh.beside(ep)
	}
	// The prompt ids P computes are checked against the verified ones
	// when a handle rides on the leg and the API returns them.
	check := p.attached && p.h.v.ids != nil && t.req.api.tokenIDs
	pctx, end := t.trace.phase(ctx, PhasePrefill, ep.url)
	got, err := p.once(pctx, ep, prefillBody(t.req, p.params(), check), attachedTokens, check)
	end(err)
	if err == nil {
		t.r.hp.succeeded(ep)
		p.got, p.url = got, ep.url
		if p.releasing {
			t.r.stats.released(p.why)
			t.rec.Released = true
		}
		return 0, nil
	}
	return p.failed(ctx, ep, err)
}

// params is the attempt's kv_transfer_params: its handle, with
// remote_kv_source naming the CPU tier to pull from when the turn has one
// and the attempt carries no retained handle (under MultiConnector the
// NixlConnector's read of that handle would load the request alone). The
// pull is by block hash and safe to repeat: each attempt names it, under
// its own transaction id.
func (p *prefiller) params() []byte {
	if p.peer.decode == "" || p.attached {
		return p.handle
	}
	p.peerTries++
	id := fmt.Sprintf("%s-kv%d", p.t.legs.id, p.peerTries)
	return peertier.WithSource(make([]byte, 0, len(p.handle)+128), p.handle, id, p.peer.host, p.peer.port)
}

// pick chooses the attempt's engine: the one that rendered the prompt when
// the retained handle rides on the leg (the tokens verified are the tokens
// it prefills), else the Selector's among those not tried. It returns a nil
// endpoint and the attempt's result when there is none.
func (p *prefiller) pick(ctx context.Context) (*endpoint, error) {
	t, tr := p.t, p.tries
	if p.attached && p.h.v.renderer != nil {
		return p.h.v.renderer, nil
	}
	// Engines whose handles did not fit their block size serve without
	// reuse (shape.go): a turn without a handle to attach keeps off them,
	// and when only they are left the decode engine prefills by itself.
	var noReuse []string
	if !p.attached {
		noReuse = t.r.shapes.avoided(t.r.prefill)
	}
	affinity := "" // a turn with no hold to attach: where its history is cached
	if !p.attached && p.f != nil {
		affinity = prefillFor(t.r.mem, p.f.cands.Keys)
		if affinity == "" && p.peer.decode != "" {
			// a tier pull: the engine that prefilled the history last
			// has it cached and pulls only what it lacks
			affinity = p.f.placed.Prefill
		}
	}
	ep, err := t.r.prefill.pick(ctx, t.r.selector, t.req, affinity, t.req.hint, slices.Concat(p.tried, noReuse))
	if errors.Is(err, ErrNoEndpoint) && len(p.tried) > len(tr.badP) {
		p.tried = append(p.tried[:0], tr.badP...) // every engine failed once: try them again
		ep, err = t.r.prefill.pick(ctx, t.r.selector, t.req, affinity, t.req.hint, slices.Concat(p.tried, noReuse))
	}
	if errors.Is(err, ErrNoEndpoint) && len(noReuse) > 0 {
		tr.local, t.rec.LocalFallback = true, true
		return nil, nil
	}
	if errors.Is(err, ErrNoEndpoint) && len(tr.badP) > 0 {
		// Only engines whose prefix cache may hold the KV of a mismatched
		// pull are left: the decode engine prefills.
		if p.attached {
			p.f.putBack(ctx, t)
			t.miss(MissRenderMismatch)
			p.attached = false
		}
		tr.local, t.rec.LocalFallback = true, true
		return nil, nil
	}
	if err != nil {
		return nil, transport.Permanent(err)
	}
	return ep, nil
}

// failed decides what follows a failed attempt on ep.
func (p *prefiller) failed(ctx context.Context, ep *endpoint, err error) (time.Duration, error) {
	t, r := p.t, p.t.r
	if errors.Is(err, errRenderMismatch) {
		// P pulled the handle for a prompt other than the verified one:
		// the handle is spent, P's answer is not sent on, and P's prefix
		// cache may hold D's blocks under its own tokens. Redo as a plain
		// miss on any other engine.
		t.miss(MissRenderMismatch)
		p.handle, p.attached = kvhandle.Miss, false
		p.tries.badP = append(p.tries.badP, ep.url)
		r.poison.Add(p.f.cands.Keys, ep.url, r.cfg.clock())
		p.tried = append(p.tried, ep.url)
		return 0, transport.Permanent(err)
	}
	released := p.releasing
	if released && ctx.Err() != nil {
		// The caller went away: whether the release reached P is unknown
		// (the leg may have been cut before it was sent), and the hold is
		// no longer the ledger's. The releaser releases it again in the
		// background (releaser.go, orphans): a release of a hold P freed
		// already is a stale notification, harmless to vLLM.
		p.handle, p.releasing = kvhandle.Miss, false
		orphaned(t, p.f.e.Endpoint, p.f.e.Handle, p.why)
		return 0, transport.Permanent(err)
	}
	if released {
		// The release handle was sent: spent whether or not P acted on it
		// (a hold not released lapses at its TTL). The leg goes on as a
		// plain miss. A failure a plain miss would also have met (a
		// connection failure, 502/503/504) is retried by the retry policy
		// as any; one only the handle can explain (another 5xx: P's
		// notification to D failed; a 4xx about it) is redone at once on
		// another engine, whatever the policy, so that a release never
		// fails a turn. A 500 is not counted against the engine, as for a
		// hit.
		r.stats.releaseFailures.Add(1)
		p.handle, p.releasing = kvhandle.Miss, false
		var ue *UpstreamError
		if ctx.Err() == nil && !retryablePrefill(err, false) && errors.As(err, &ue) && ue.Status != 0 &&
			(ue.Status >= 500 || ue.Status/100 == 4 && ue.Status != http.StatusTooManyRequests) && !errors.Is(err, ErrNoHandle) {
			if unhealthy(err, true) {
				r.hp.failed(ep, err)
			}
			p.tried = append(p.tried, ep.url)
			return 0, transport.Permanent(fmt.Errorf("%w: %w", errReleaseFailed, err))
		}
	}
	if ctx.Err() == nil && unhealthy(err, p.attached || released) {
		r.hp.failed(ep, err)
	}
	if ctx.Err() != nil || !retryablePrefill(err, p.attached) {
		return 0, transport.Permanent(err)
	}
	if p.attached {
		// The handle was sent: whether or not P read it, it is spent.
		r.stats.hitRetries.Add(1)
		t.miss(MissRetry)
		p.handle, p.attached = kvhandle.Miss, false
	}
	return p.retry(ctx, ep, err)
}

// retry has the next attempt avoid ep, and returns what transport.Retry
// waits for before it.
func (p *prefiller) retry(ctx context.Context, ep *endpoint, err error) (time.Duration, error) {
	t := p.t
	p.tried = append(p.tried, ep.url)
	t.r.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: prefill failed; retrying",
		slog.String("request_id", t.id), slog.String("engine_request_id", t.legs.id), slog.String("endpoint", ep.url), slog.String("err", err.Error()))
	var ue *UpstreamError
	errors.As(err, &ue)
	return ue.retryAfter, err
}

// prefillBody is the client's body as the prefill leg sends it: the API's
// one-token rewrite and handle (the retained D handle, or the miss handle),
// and return_token_ids when the leg's prompt ids are to be checked.
func prefillBody(req *Request, handle []byte, askIDs bool) legBody {
	a := req.api
	set := append(slices.Clip(a.prefillSet), jsonraw.Member{Key: kvKey, Value: handle})
	if askIDs {
		set = append(set, jsonraw.Member{Key: "return_token_ids", Value: jsonTrue})
	}
	return req.obj.EditPieces(make(legBody, 0, 24), a.prefillDrop, set...)
}
