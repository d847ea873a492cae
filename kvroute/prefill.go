package kvroute

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/transport"
)

// Members removed from the client's body on the decode leg.
var decodeDrop = []string{kvKey, "conversation_id"}

// maxErrorBody bounds how much of an engine's error body is kept.
const maxErrorBody = 64 << 10

var (
	jsonOne = []byte("1")
)

// prefillBody is the client's body as the prefill leg sends it: the API's
// one-token rewrite and handle (the retained D handle, or the miss handle),
// and return_token_ids when the leg's prompt ids are to be checked.
func (t *turn) prefillBody(handle []byte, askIDs bool) legBody {
	a := t.req.api
	set := append(slices.Clip(a.prefillSet()), jsonraw.Member{Key: kvKey, Value: handle})
	if askIDs {
		set = append(set, jsonraw.Member{Key: "return_token_ids", Value: jsonTrue})
	}
	return t.req.obj.EditPieces(make(legBody, 0, 24), a.prefillDrop(), set...)
}

// legBody is an upstream request body as pieces sent in order: the
// client's bytes with the edited members spliced in (jsonraw.EditPieces),
// written with vectored I/O and never copied whole.
type legBody [][]byte

// size returns the body's length.
func (b legBody) size() int {
	n := 0
	for _, p := range b {
		n += len(p)
	}
	return n
}

// reader returns a new reader of the whole body, holding a reference to
// the pooled client body it aliases (if any) until net/http closes it.
func (b legBody) reader(ref *bodyRef) *transport.Buffers {
	if ref == nil {
		return transport.NewBuffers(b, nil)
	}
	ref.acquire()
	return transport.NewBuffers(b, ref.rel)
}

// runPrefill sends the prefill leg, retrying safe failures on other
// engines, and returns P's handle (nil when P gave none and the local
// fallback is on) and P's URL. A retained handle goes to the first attempt
// only: every retry is a plain miss, so a consumed handle is never resent.
func (t *turn) runPrefill(ctx context.Context, ent *entry.Entry) ([]byte, string, error) {
	handle, attached := kvhandle.Miss, false
	if ent != nil {
		h, err := kvhandle.ForHit(ent.Handle, t.r.cfg.blockSize)
		if err != nil {
			if errors.Is(err, kvhandle.ErrInvalid) {
				t.r.invalidHandle(PhaseLookup, ent.Endpoint, err)
			}
			t.miss(MissBadEntry)
		} else {
			handle, attached = h, true
		}
	}
	start := t.r.cfg.clock()
	var (
		tried = append(slices.Clone(t.avoidP), t.badP...) // a redone turn prefers a fresh engine
		ph    []byte
		url   string
	)
	attempt := func(int) (time.Duration, error) {
		var ep *endpoint
		if attached && t.renderEP != nil {
			// The engine that rendered the prompt computes it: the tokens
			// verified are the tokens it prefills.
			ep = t.renderEP
		} else {
			var err error
			ep, err = t.r.prefill.pick(ctx, t.r.selector, t.req, "", t.hint, tried)
			if errors.Is(err, ErrNoEndpoint) && len(tried) > len(t.badP) {
				tried = append(tried[:0], t.badP...) // every engine failed once: try them again
				ep, err = t.r.prefill.pick(ctx, t.r.selector, t.req, "", t.hint, tried)
			}
			if errors.Is(err, ErrNoEndpoint) && len(t.badP) > 0 {
				// Only engines whose prefix cache may hold the KV of a
				// mismatched pull are left: the decode engine prefills.
				if attached {
					t.putBack(ctx, t.entKey, ent, t.entAge)
					t.miss(MissRenderMismatch)
				}
				t.local, t.rec.LocalFallback = true, true
				return 0, nil
			}
			if err != nil {
				return 0, transport.Permanent(err)
			}
		}
		t.rec.PrefillAttempts++
		t.rec.PrefillEndpoint = ep.url
		attachedTokens := 0
		if attached {
			attachedTokens = ent.Tokens
		}
		// A prompt to fingerprint for the next turn renders beside the leg.
		t.startBackgroundRender(ep)
		// The prompt ids P computes are checked against the verified ones
		// when a handle rides on the leg and the API returns them.
		check := attached && t.verified != nil && t.req.api.tokenIDs()
		pctx, end := t.startPhase(ctx, PhasePrefill, ep.url)
		h, err := t.prefillOnce(pctx, ep, t.prefillBody(handle, check), attachedTokens, check)
		end(err)
		if err == nil {
			t.r.hp.succeeded(ep)
			ph, url = h, ep.url
			return 0, nil
		}
		if errors.Is(err, errRenderMismatch) {
			// P pulled the handle for a prompt other than the verified
			// one: the handle is spent, P's answer is not sent on, and
			// P's prefix cache may hold D's blocks under its own tokens.
			// Redo as a plain miss on any other engine.
			t.miss(MissRenderMismatch)
			handle, attached = kvhandle.Miss, false
			t.badP = append(t.badP, ep.url)
			t.r.poison.add(t.cands.Keys, ep.url, t.r.cfg.clock())
			tried = append(tried, ep.url)
			return 0, transport.Permanent(err)
		}
		if ctx.Err() == nil && unhealthy(err, attached) {
			t.r.hp.failed(ep, err)
		}
		if ctx.Err() != nil || !retryablePrefill(err, attached) {
			return 0, transport.Permanent(err)
		}
		if attached {
			// The handle was sent: whether or not P read it, it is spent.
			t.r.stats.hitRetries.Add(1)
			t.miss(MissRetry)
			handle, attached = kvhandle.Miss, false
		}
		tried = append(tried, ep.url)
		t.r.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: prefill failed; retrying",
			slog.String("request_id", t.id), slog.String("engine_request_id", t.legID), slog.String("endpoint", ep.url), slog.String("err", err.Error()))
		var ue *UpstreamError
		errors.As(err, &ue)
		return ue.retryAfter, err
	}
	err := transport.Retry(ctx, t.r.cfg.retry, attempt)
	if errors.Is(err, errRenderMismatch) {
		// Redone once as a plain miss, whatever the retry policy: no
		// handle rides on it, so it cannot mismatch again.
		err = transport.Retry(ctx, t.r.cfg.retry, attempt)
	}
	if err != nil {
		return nil, "", err
	}
	t.pDone = t.r.cfg.clock()
	t.rec.Prefill = t.pDone.Sub(start)
	if t.local {
		return nil, "", nil
	}
	return ph, url, nil
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

// prefillOnce sends one prefill request and returns P's handle. attached is
// remote_num_tokens of the retained handle the request carries, 0 for a
// miss; check says the leg asked for P's prompt ids, to be compared with
// the verified ones (checkPrefillIDs).
func (t *turn) prefillOnce(ctx context.Context, ep *endpoint, body legBody, attached int, check bool) ([]byte, error) {
	ep.inflight.Add(1)
	defer ep.inflight.Add(-1)
	hreq, err := t.upstreamRequest(ctx, PhasePrefill, ep, body)
	if err != nil {
		return nil, err
	}
	resp, err := t.r.client.Do(hreq, transport.Deadlines{Total: t.r.cfg.prefillTimeout})
	if err != nil {
		return nil, &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Err: err}
	}
	defer resp.Body.Close()
	if resp.StatusCode/100 != 2 {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, maxErrorBody))
		ue := &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Status: resp.StatusCode, Body: clientSafe(b), Err: errors.New(http.StatusText(resp.StatusCode))}
		if d, ok := transport.RetryAfter(resp.Header, t.r.cfg.clock()); ok {
			ue.retryAfter = d
		}
		return nil, ue
	}
	b, err := readSized(resp.Body, resp.ContentLength, t.r.cfg.maxBodyBytes, nil)
	if err != nil {
		return nil, &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Status: resp.StatusCode, Err: err}
	}
	obj, err := jsonraw.Parse(b)
	if err != nil {
		return nil, &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Status: resp.StatusCode, Err: errors.New("response is not a JSON object")}
	}
	t.confirm(obj, attached)
	if check {
		if err := t.checkPrefillIDs(obj, ep, attached); err != nil {
			return nil, err
		}
	}
	h, ok := obj.Get(kvKey)
	if !ok || jsonraw.IsNull(h) {
		return nil, t.noHandle(ep, resp.StatusCode, errors.New("the answer has none"))
	}
	hi, err := kvhandle.Check(h, t.r.cfg.blockSize)
	if err != nil {
		if errors.Is(err, kvhandle.ErrInvalid) {
			t.r.invalidHandle(PhasePrefill, ep.url, err)
		}
		return nil, t.noHandle(ep, resp.StatusCode, err)
	}
	if hi.PushMode {
		t.r.stats.pushHandles.Add(1)
		return nil, t.noHandle(ep, resp.StatusCode, errPushHandle)
	}
	return slices.Clip(h), nil
}

var errPushHandle = errors.New(`handle has transfer_mode "push", which cannot be used bidirectionally`)

// errRenderMismatch: the prefill engine computed other prompt tokens than
// its render answered, within the handle's attached prefix.
var errRenderMismatch = errors.New("kvroute: the prefill engine computed other prompt tokens than its render answered")

// checkPrefillIDs compares the prompt ids a prefill answer carries (its
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
func (t *turn) checkPrefillIDs(obj jsonraw.Object, ep *endpoint, attached int) error {
	r := t.r
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
	n := min(attached, len(t.verified))
	prefixOK := len(ids) >= n && slices.Equal(ids[:n], t.verified[:n])
	if prefixOK && slices.Equal(ids, t.verified) {
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
func (t *turn) confirm(obj jsonraw.Object, attached int) {
	t.rec.CachedTokens = -1
	usage, ok := obj.Get("usage")
	if !ok {
		return
	}
	details, ok := jsonraw.Lookup(usage, "prompt_tokens_details")
	if !ok {
		return
	}
	v, ok := jsonraw.Lookup(details, "cached_tokens")
	if !ok {
		return
	}
	cached, ok := jsonraw.Int(v)
	if !ok {
		return
	}
	t.rec.CachedTokens = int(cached)
	if attached <= 0 {
		return
	}
	want := int64(attached)
	if v, ok := jsonraw.Lookup(usage, "prompt_tokens"); ok {
		if p, ok := jsonraw.Int(v); ok && p > 0 && p < want {
			want = p
		}
	}
	if cached < want-1 {
		t.rec.Unconfirmed = true
		t.r.stats.unconfirmedHits.Add(1)
		t.r.log.once(context.Background(), "unconfirmed", "kvroute: a prefill engine reported fewer cached tokens than the retained handle it was given; it did not read the retained KV",
			slog.Int("cached_tokens", int(cached)), slog.Int("attached_tokens", attached))
	}
}

// noHandle handles a prefill answer without a usable handle: an error, or
// with the local fallback a nil handle (D will prefill by itself).
func (t *turn) noHandle(ep *endpoint, status int, cause error) error {
	t.r.stats.noPrefillHandle.Add(1)
	t.rec.NoHandle = PhasePrefill
	if t.r.cfg.localFallback {
		t.local, t.rec.LocalFallback = true, true
		t.r.log.LogAttrs(context.Background(), slog.LevelWarn, "kvroute: prefill engine returned no handle; decode will prefill locally",
			slog.String("request_id", t.id), slog.String("engine_request_id", t.legID), slog.String("endpoint", ep.url))
		return nil
	}
	return &UpstreamError{Phase: PhasePrefill, Endpoint: ep.url, Status: status, Err: errors.Join(ErrNoHandle, cause)}
}

// upstreamRequest builds a POST of body to ep for the client's path, with
// the client's end-to-end headers, the turn's engine request id (legID)
// and the upstream credential.
func (t *turn) upstreamRequest(ctx context.Context, phase Phase, ep *endpoint, body legBody) (*http.Request, error) {
	return t.upstreamRequestTo(ctx, phase, ep, t.req.Path, body, t.legID)
}

// upstreamRequestTo is upstreamRequest for another path of the engine,
// with request id id.
//
// The URL is a copy of the endpoint's cached one for path, and the legs
// of a turn share one read-only header map (legHeader) unless a leg needs
// headers of its own: a rank pin, a trace context, another request id.
// net/http's RoundTrip only reads Request.Header and transport.Client
// does not copy it, so no one writes the shared map after legHeader.
func (t *turn) upstreamRequestTo(ctx context.Context, phase Phase, ep *endpoint, path string, body legBody, id string) (*http.Request, error) {
	rd := body.reader(t.req.ref)
	u, err := ep.pathURL(path)
	if err != nil {
		_ = rd.Close()
		return nil, &UpstreamError{Phase: phase, Endpoint: ep.url, Err: err}
	}
	// An empty URL parses to an empty *url.URL, which is then overwritten
	// with the cached one: one URL allocation, no parse of the address.
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, "", rd)
	if err != nil {
		_ = rd.Close()
		return nil, &UpstreamError{Phase: phase, Endpoint: ep.url, Err: err}
	}
	*hreq.URL = *u
	hreq.Host = u.Host
	h := t.legHeader()
	if ep.ep.Rank >= 0 || t.r.cfg.tracer != nil || id != t.legID {
		h = h.Clone()
		h.Set(headerRequestID, id)
		t.inject(ctx, h)
		ep.ep.ApplyHeader(h)
	}
	hreq.Header = h
	hreq.ContentLength = int64(body.size())
	// For net/http's retry of a request a reused connection lost before
	// it was written.
	hreq.GetBody = func() (io.ReadCloser, error) { return body.reader(t.req.ref), nil }
	return hreq, nil
}

// legHeader returns the headers every leg of the turn sends, built on the
// first call: the client's end-to-end headers (transport.RequestHeader,
// which drops the rank header), the JSON content type, the turn's engine
// request id (legID) and the upstream credential. The map is shared by the
// turn's requests: it must not be modified.
func (t *turn) legHeader() http.Header {
	if t.hdr != nil {
		return t.hdr
	}
	h := transport.RequestHeader(t.req.Header)
	// One backing array for the values set here.
	vals := []string{"application/json", t.legID, ""}
	h["Content-Type"] = vals[0:1:1]
	h[headerRequestID] = vals[1:2:2]
	if t.r.cfg.apiKey != "" {
		vals[2] = "Bearer " + t.r.cfg.apiKey
		h["Authorization"] = vals[2:3:3]
	}
	t.hdr = h
	return h
}

var errBodyTooLarge = errors.New("body exceeds the size limit")

// readSized reads a body of the given Content-Length (-1: unknown) into
// one buffer of that size from get (make when nil), or as readLimited when
// the length is unknown or over the limit.
func readSized(r io.Reader, length, limit int64, get func(int) []byte) ([]byte, error) {
	if length <= 0 || length > limit {
		return readLimited(r, limit)
	}
	return readExact(r, length, get)
}

// readExact reads a body of length bytes into a buffer from get (make when
// nil); a longer body is an error.
func readExact(r io.Reader, length int64, get func(int) []byte) ([]byte, error) {
	var b []byte
	if get != nil {
		b = get(int(length))
	} else {
		b = make([]byte, length)
	}
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	var one [1]byte
	if n, _ := r.Read(one[:]); n > 0 {
		return nil, errors.New("the body is longer than its Content-Length")
	}
	return b, nil
}

func readLimited(r io.Reader, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, errBodyTooLarge
	}
	return b, nil
}
