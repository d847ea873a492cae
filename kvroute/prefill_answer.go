package kvroute

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"slices"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/kvroute/internal/peertier"
	"github.com/bidikv/bidikv/transport"
)

// The prefill engine's answer: its handle, checked before it goes to D;
// the cached tokens that confirm a hit; the prompt ids it computed, checked
// against the verified ones.

// once sends one prefill request and returns P's handle (nil when P gave
// none and D prefills locally). attached is remote_num_tokens of the
// retained handle the request carries, 0 for a miss; check says the leg
// asked for P's prompt ids, to be compared with the verified ones
// (checkIDs).
func (p *prefiller) once(ctx context.Context, ep *endpoint, body legBody, attached int, check bool) ([]byte, error) {
	t := p.t
	ep.inflight.Add(1)
	defer ep.inflight.Add(-1)
	hreq, err := t.legs.request(ctx, PhasePrefill, ep, body)
	if err != nil {
		return nil, err
	}
	resp, err := t.r.client.send(hreq, PhasePrefill, ep, transport.Deadlines{Total: t.r.cfg.prefillTimeout})
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	b, err := readSized(resp.Body, resp.ContentLength, t.r.cfg.maxBodyBytes, nil)
	if err != nil {
		return nil, &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Status: resp.StatusCode, Err: err}
	}
	// The handle's block list is read as the answer is validated.
	var obj jsonraw.Object
	blocks, err := kvhandle.ResetAnswer(&obj, b)
	if err != nil {
		return nil, &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Status: resp.StatusCode, Err: errors.New("response is not a JSON object")}
	}
	p.confirm(obj, attached)
	if check {
		if err := p.checkIDs(obj, ep, attached); err != nil {
			return nil, err
		}
	}
	h, ok := obj.Get(kvKey)
	if !ok || jsonraw.IsNull(h) {
		p.t.lacks(p.t.r.learned.noHandle(ep.url, p.t.req.Path, PhasePrefill))
		return nil, p.noHandle(ep, resp.StatusCode, errors.New("the answer has none"))
	}
	hi, err := t.r.shapes.check(ctx, ep, h, blocks)
	switch {
	case errors.Is(err, kvhandle.ErrBlockCount):
		// Its blocks do not fit the engine's block size (counted and
		// logged by shapes): never sent to D, and never a failure of the
		// turn: D prefills by itself, a plain request.
		p.tries.local, t.rec.LocalFallback = true, true
		return nil, nil
	case err != nil:
		if errors.Is(err, kvhandle.ErrInvalid) {
			t.r.invalidHandle(PhasePrefill, ep.url, err)
		}
		return nil, p.noHandle(ep, resp.StatusCode, err)
	}
	if hi.PushMode {
		t.r.stats.pushHandles.Add(1)
		return nil, p.noHandle(ep, resp.StatusCode, errPushHandle)
	}
	return slices.Clip(h), nil
}

var errPushHandle = errors.New(`handle has transfer_mode "push", which cannot be used bidirectionally`)

// errRenderMismatch: the prefill engine computed other prompt tokens than
// its render answered, within the handle's attached prefix.
var errRenderMismatch = errors.New("kvroute: the prefill engine computed other prompt tokens than its render answered")

// checkIDs compares the prompt ids a prefill answer carries (its
// top-level prompt_token_ids, or choice 0's on completions) with the
// tokens verification compared with the handle. Any difference means the
// engine's renderer does not say what the engine computes (a stale or
// mixed-version renderer behind the engine's URL): it is counted
// (Stats.RenderMismatches), logged once per engine, and the engine is not
// asked to render for renderDistrust. A difference within the attached
// prefix means P pulled D's blocks as the prefix of another prompt: the
// error redoes the turn as a plain miss, so the client never gets that
// answer. An answer without prompt ids cannot be checked (counted in
// Stats.UncheckedPrefills, logged once).
func (p *prefiller) checkIDs(obj jsonraw.Object, ep *endpoint, attached int) error {
	r := p.t.r
	verified := p.h.v.ids
	v, ok := obj.Get(capture.PromptTokenIDsKey)
	if !ok || jsonraw.IsNull(v) {
		choices, _ := obj.Get("choices")
		_ = jsonraw.Elements(choices, func(c []byte) error {
			v, ok = jsonraw.Lookup(c, capture.PromptTokenIDsKey)
			return errStop
		})
	}
	var ids []uint32
	parsed := false
	if ok && !jsonraw.IsNull(v) {
		ids, parsed = capture.AppendTokenIDs(nil, v)
	}
	if !parsed {
		r.stats.uncheckedPrefills.Add(1)
		r.log.once(context.Background(), "unchecked_prefill", "kvroute: a prefill engine answered without prompt_token_ids (return_token_ids, vLLM PR #22587); the tokens it computed cannot be checked against the verified ones",
			slog.String("endpoint", ep.url))
		return nil
	}
	n := min(attached, len(verified))
	prefixOK := len(ids) >= n && slices.Equal(ids[:n], verified[:n])
	if prefixOK && slices.Equal(ids, verified) {
		return nil
	}
	r.stats.renderMismatches.Add(1)
	r.renders.caps.distrustFor(ep.url, r.cfg.clock(), renderDistrust)
	r.log.once(context.Background(), "render_mismatch:"+ep.url, "kvroute: a prefill engine computed other prompt tokens than its render answered (a stale or mixed-version renderer?); it is not asked to render for a while, and a turn whose attached prefix differed is redone as a plain miss on another engine",
		slog.String("endpoint", ep.url), slog.Bool("within_attached_prefix", !prefixOK))
	if prefixOK {
		return nil
	}
	return &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Status: http.StatusOK, Err: errRenderMismatch}
}

// confirm reads usage.prompt_tokens_details.cached_tokens of a prefill
// answer and, on a hit, checks that the engine loaded what the router
// attached: at least min(attached, prompt_tokens) less one, the last prompt
// token, which the engine always recomputes. Without prompt_tokens_details
// there is nothing to check.
func (p *prefiller) confirm(obj jsonraw.Object, attached int) {
	t := p.t
	t.rec.CachedTokens = -1
	usage, ok := obj.Get("usage")
	if !ok {
		return
	}
	cached, prompt, ok := cachedTokens(usage)
	if prompt > 0 {
		p.prompt = prompt // the decode leg's live tokens (memory.go)
		if p.peer.decode != "" && !p.attached {
			t.rec.PeerTokens = peertier.Loadable(p.peer.resident, p.prompt, t.r.shapes.known(t.r.decode.find(p.peer.decode)))
		}
	}
	if !ok {
		return
	}
	t.rec.CachedTokens = int(cached)
	if attached <= 0 {
		p.confirmPeer(cached)
		return
	}
	want := int64(attached)
	if prompt > 0 && int64(prompt) < want {
		want = int64(prompt)
	}
	if cached < want-1 {
		t.rec.Unconfirmed = true
		t.r.stats.unconfirmedHits.Add(1)
		t.r.log.once(context.Background(), "unconfirmed", "kvroute: a prefill engine reported fewer cached tokens than the retained handle it was given; it did not read the retained KV",
			slog.Int("cached_tokens", int(cached)), slog.Int("attached_tokens", attached))
	}
}

// cachedTokens reads an answer's usage object (nil: none): its
// prompt_tokens (0 when absent) and prompt_tokens_details.cached_tokens
// (ok false when absent: engines without --enable-prompt-tokens-details
// send null details). vLLM counts in cached_tokens (num_cached_tokens)
// what the request found in the prefix cache and what a KV connector
// loaded for it, a CPU tier's chunks included.
func cachedTokens(usage []byte) (cached int64, prompt int, ok bool) {
	if len(usage) == 0 {
		return 0, 0, false
	}
	if v, found := jsonraw.Lookup(usage, "prompt_tokens"); found {
		if n, isInt := jsonraw.Int(v); isInt && n > 0 {
			prompt = int(n)
		}
	}
	details, found := jsonraw.Lookup(usage, "prompt_tokens_details")
	if !found {
		return 0, prompt, false
	}
	v, found := jsonraw.Lookup(details, "cached_tokens")
	if !found {
		return 0, prompt, false
	}
	cached, ok = jsonraw.Int(v)
	return cached, prompt, ok
}

// tierShort reports whether an engine whose prompt is prompt tokens (0:
// unknown) and that reported cached tokens loaded less than estimated,
// the tokens a CPU tier was estimated to hold of it, less one block of
// bs: the tier lacked what the ledger estimated it held.
func tierShort(estimated, bs, prompt int, cached int64) bool {
	want := int64(estimated) - int64(max(bs, 1))
	if prompt > 0 {
		want = min(want, int64(prompt-1))
	}
	return cached < want
}

// tierAdvice is what the logs of a shortfall (confirmPeer, confirmLocal)
// advise.
const tierAdvice = "; if it keeps happening the tier evicts sooner than CPUTierTokens says, or the engines are misconfigured (hash seed, block size, port): run the proxy's doctor --cpu-tier --probe"

// confirmPeer checks, for a turn whose prefill leg pulled from a decode
// engine's CPU tier (and attached no GPU hold), that the engine reports at
// least the tokens the ledger estimated that tier held, less a block: its
// cached tokens count its prefix-cache hits and what it loaded, the tier's
// chunks included. A shortfall is a pull that missed (the tier evicted
// them, or a misconfiguration makes every pull miss: hash seed, block
// size, port): counted (Stats.PeerShort, TurnRecord.PeerShort) and
// logged once per decode engine, with the check to run.
func (p *prefiller) confirmPeer(cached int64) {
	t := p.t
	if p.peer.decode == "" || p.attached || p.peer.resident <= 0 {
		return
	}
	if !tierShort(p.peer.resident, t.r.shapes.known(t.r.decode.find(p.peer.decode)), p.prompt, cached) {
		return
	}
	t.rec.PeerShort = true
	t.r.stats.peerShort.Add(1)
	t.r.log.once(context.Background(), "peer_short:"+p.peer.decode, "kvroute: a prefill engine loaded less of a conversation than the decode engine's CPU tier was estimated to hold"+tierAdvice,
		slog.String("decode", p.peer.decode), slog.Int64("cached_tokens", cached), slog.Int("estimated_tokens", p.peer.resident))
}

// confirmLocal checks, for a decode-local turn chosen on the ledger's
// estimate that its decode engine ep's CPU tier holds estimated tokens of
// the conversation (chosen.tier), that the engine's answer (usage, its
// usage object) reports at least that less a block cached. A shortfall
// is a reload that missed: the engine recomputed the history itself.
// Counted (Stats.LocalShort, TurnRecord.LocalShort) and logged once per
// decode engine; an answer without prompt_tokens_details is not checked.
func confirmLocal(t *turn, ep *endpoint, estimated int, usage []byte) {
	cached, prompt, ok := cachedTokens(usage)
	if !ok || estimated <= 0 || !tierShort(estimated, t.r.shapes.known(ep), prompt, cached) {
		return
	}
	t.rec.LocalShort = true
	t.r.stats.localShort.Add(1)
	t.r.log.once(context.Background(), "local_short:"+ep.url, "kvroute: a decode-local turn's decode engine reloaded less of a conversation from its CPU tier than it was estimated to hold, and computed the rest"+tierAdvice,
		slog.String("decode", ep.url), slog.Int64("cached_tokens", cached), slog.Int("estimated_tokens", estimated))
}

// noHandle handles a prefill answer without a usable handle: an error, or
// with the local fallback a nil handle (D will prefill by itself).
func (p *prefiller) noHandle(ep *endpoint, status int, cause error) error {
	t := p.t
	t.r.stats.noPrefillHandle.Add(1)
	t.rec.NoHandle = PhasePrefill
	if t.r.cfg.localFallback {
		p.tries.local, t.rec.LocalFallback = true, true
		t.r.log.LogAttrs(context.Background(), slog.LevelWarn, "kvroute: prefill engine returned no handle; decode will prefill locally",
			slog.String("request_id", t.id), slog.String("engine_request_id", t.legs.id), slog.String("endpoint", ep.url))
		return nil
	}
	return &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Status: status, Err: errors.Join(ErrNoHandle, cause)}
}

// unhealthy reports whether a failed leg counts against the endpoint's
// health: connection failures, timeouts and 5xx answers, except the 500
// of a prefill whose read of a retained handle failed (the handle's fault,
// not the engine's). A prefill answer without a handle does not count.
func unhealthy(err error, hit bool) bool {
	var ue *UpstreamError
	if !errors.As(err, &ue) || errors.Is(err, ErrNoHandle) || errors.Is(err, context.Canceled) {
		return false
	}
	switch {
	case ue.Status == 0:
		return true
	case ue.Status == http.StatusInternalServerError && hit && ue.Phase == PhasePrefill:
		return false
	}
	return ue.Status >= 500 || ue.Status/100 == 2 // 2xx: the body or stream broke
}

// retryablePrefill reports whether a failed prefill attempt may be retried:
// connection failures and 502/503/504 always; any 5xx when a handle was
// attached, since the engine's KV load may have failed and a plain
// prefill can still serve the turn.
func retryablePrefill(err error, hit bool) bool {
	var ue *UpstreamError
	if !errors.As(err, &ue) {
		return false
	}
	if errors.Is(err, ErrNoHandle) {
		return false
	}
	// One classifier for the exchange (transport.Retryable): connection
	// failures, a pooled connection the engine had closed, a stalled
	// engine, 502/503/504. Not the caller's cancellation nor our own
	// prefill deadline, which would only double the load on a slow engine.
	// A retry is always a plain miss, so it is safe.
	if ue.Status == 0 {
		return transport.Retryable(nil, ue.Err)
	}
	if transport.Retryable(&http.Response{StatusCode: ue.Status}, nil) {
		return true
	}
	// Any 5xx when a handle was attached: the engine's KV load may have
	// failed, and a plain prefill can still serve the turn.
	return hit && ue.Status >= 500
}
