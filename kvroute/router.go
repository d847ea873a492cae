package kvroute

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/sse"
	"github.com/bidikv/bidikv/threshold"
	"github.com/bidikv/bidikv/transport"
)

// Router runs turns of multi-turn conversations over prefill and decode
// engines, carrying decode handles from one turn to the next. A Router is
// safe for concurrent use.
type Router struct {
	cfg      config
	client   *transport.Client
	log      logger
	policy   threshold.Policy
	chooser  threshold.Chooser // WithDecodeLocal: chooses each verified turn's path
	learner  threshold.Learner // the chooser's, when it learns
	ident    Identifier
	tenant   TenantFunc
	selector Selector
	prefill  *pool
	decode   *pool
	hp       *healthPolicy
	handles  handles   // the Store's side (store.go)
	renders  renderers // the prefill engines' renderers (renderer.go)
	restarts restarts  // the decode engines' processes (restart.go)
	poison   poisoned  // prefill engines conversations avoid (poison.go)
	closers  []func() error

	closed atomic.Bool
	stats  counters

	noStreamHandle sync.Once
	streamHandles  sync.Map // decode endpoint URL -> struct{}: it has sent a handle in a stream

	bufs      bufpool.Bytes    // request bodies (ServeHTTP), render answers, stream buffers
	streamBuf atomic.Int64     // the size of the last stream's buffer, for the next one's
	renderBuf atomic.Int64     // the same for render answers of unknown length
	handleBuf atomic.Int64     // the length of the last stream's decode handle, for the next one's buffer
	ids       bufpool.IDs      // rendered prompts' and streams' prompt token ids, returned when their turn ends
	promptIDs atomic.Int64     // the length of the last stream's prompt ids, for the next one's slice
	maxEvent  sse.ReaderOption // sse.WithMaxEventSize(cfg.maxEventBytes), made once
}

// New returns a Router configured by opts. It validates every option and
// returns an error wrapping ErrInvalidConfig that names the option at fault.
// New does no network I/O.
func New(opts ...Option) (*Router, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		o.apply(&cfg)
	}
	cfg.validate()
	r := &Router{cfg: cfg}
	r.hp = &healthPolicy{cfg: cfg.ends, clock: cfg.clock}
	if eo, ok := cfg.observer.(EndpointObserver); ok {
		r.hp.observer = eo
	}
	var err error
	if r.prefill, err = newPool(PhasePrefill, r.hp, cfg.prefill, cfg.ends.prefill); err != nil {
		cfg.fail("WithPrefill", "%v", err)
	}
	if r.decode, err = newPool(PhaseDecode, r.hp, cfg.decode, cfg.ends.decode); err != nil {
		cfg.fail("WithDecode", "%v", err)
	}
	if len(cfg.errs) > 0 {
		return nil, errors.Join(cfg.errs...)
	}
	r.log.Logger = cfg.logger
	if r.log.Logger == nil {
		r.log.Logger = slog.New(slog.DiscardHandler)
	}
	if err := r.connect(); err != nil {
		return nil, err
	}
	if err := r.decide(); err != nil {
		return nil, err
	}
	r.ident, r.tenant, r.selector = cfg.identifier, cfg.tenant, cfg.selector
	if r.ident == nil {
		r.ident = ContinuationKeys{}
	}
	if r.tenant == nil {
		r.tenant = PrincipalTenant
	}
	if r.selector == nil {
		r.selector = &LeastLoaded{MaxInFlight: DefaultAffinityMaxInFlight}
	}
	r.renders = renderers{prefill: r.prefill, client: r.client, clock: cfg.clock, maxBody: cfg.maxBodyBytes, stats: &r.stats, log: &r.log}
	r.renders.bgCtx, r.renders.bgCancel = context.WithCancel(context.Background())
	r.restarts = restarts{decode: r.decode, client: r.client, maxAge: cfg.restartCheck, apiKey: cfg.apiKey, clock: cfg.clock, stats: &r.stats, log: &r.log}
	r.closers = append([]func() error{r.renders.close}, r.closers...)
	if stop := startProbes(r.hp, r.client, cfg.apiKey, r.prefill, r.decode); stop != nil {
		// Stop the probes before the transport's connections are closed.
		r.closers = append([]func() error{stop}, r.closers...)
	}
	return r, nil
}

// connect makes the Router's upstream client and its Store.
func (r *Router) connect() error {
	cfg := &r.cfg
	rt := cfg.transport
	if rt == nil {
		t, err := transport.NewTransport()
		if err != nil {
			return fmt.Errorf("%w: WithTransport: %v", ErrInvalidConfig, err)
		}
		rt = t
		r.closers = append(r.closers, func() error { t.CloseIdleConnections(); return nil })
	}
	r.client = transport.NewClient(rt)
	r.maxEvent = sse.WithMaxEventSize(cfg.maxEventBytes)
	store := cfg.store
	if store == nil {
		m, err := retention.NewMemory(retention.WithMaxValueSize(cfg.maxEntryBytes))
		if err != nil {
			return fmt.Errorf("%w: WithMaxEntryBytes: %v", ErrInvalidConfig, err)
		}
		store = m
		r.closers = append(r.closers, m.Close)
	}
	r.handles = handles{store: store, ttl: cfg.retentionTTL, maxEntry: cfg.maxEntryBytes, clock: cfg.clock,
		bufs: &r.bufs, stats: &r.stats, log: &r.log}
	return nil
}

// decide makes the reuse policy and, for decode-local turns, the Chooser.
func (r *Router) decide() error {
	cfg := &r.cfg
	r.policy = cfg.policy
	if r.policy == nil {
		p, err := threshold.Engine(cfg.threshold)
		if err != nil {
			return fmt.Errorf("%w: WithThreshold: %v", ErrInvalidConfig, err)
		}
		r.policy = p
	}
	if cfg.decodeLocal {
		if r.chooser, _ = r.policy.(threshold.Chooser); r.chooser == nil {
			m, err := threshold.NewCostModel(threshold.CostConfig{Threshold: cfg.threshold})
			if err != nil {
				return fmt.Errorf("%w: WithDecodeLocal: %v", ErrInvalidConfig, err)
			}
			r.chooser = m
		}
		r.learner, _ = r.chooser.(threshold.Learner)
	}
	return nil
}

// Close stops what the Router started. Turns already running finish; Do
// returns ErrClosed afterwards. Close is idempotent.
func (r *Router) Close() error {
	if r.closed.Swap(true) {
		return nil
	}
	var errs []error
	for _, c := range r.closers {
		if err := c(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Stats returns the Router's counters since New.
func (r *Router) Stats() Stats { return r.stats.snapshot() }

// Do runs one turn: look up a retained handle, prefill on a prefill engine,
// decode on a decode engine, and return the decode engine's response with
// every kv_transfer_params removed. The handle D returns is retained when
// the turn ends: at once for a non-streaming response, when the stream's
// last event has been read for a streaming one.
//
// The caller must Close the Response. An error before any response maps to
// an HTTP status with HTTPStatus. Do does not modify req.Body. The context
// governs both legs and the whole stream: cancelling it aborts the decode
// request on the engine.
func (r *Router) Do(ctx context.Context, req *Request) (*Response, error) {
	t := r.newTurn(req)
	ctx = t.startTurn(ctx)
	if r.closed.Load() {
		return nil, t.fail(PhaseLookup, ErrClosed)
	}
	if err := req.parse(r.cfg.maxMembers); err != nil {
		return nil, t.fail(PhaseLookup, err)
	}
	t.stream = req.Streaming()
	t.rec.Stream = t.stream
	req.setPrincipal(ctx)
	req.tenant = r.tenant(req)
	t.hint = ConversationHint(req)
	lctx, endLookup := t.startPhase(ctx, PhaseLookup, "")
	ent := t.lookup(lctx)
	endLookup(nil)
	if t.localEP != nil {
		resp, err := t.runLocal(ctx)
		if err == nil {
			return resp, nil
		}
		if !t.redo(ctx, err) {
			return nil, t.fail(PhaseDecode, err)
		}
		t.localFailed(ctx, err)
	}
	for {
		ph, pURL, err := t.runPrefill(ctx, ent)
		if err != nil {
			return nil, t.fail(PhasePrefill, err)
		}
		resp, err := t.runDecode(ctx, ph, pURL, ent)
		if err == nil {
			return resp, nil
		}
		if !t.redo(ctx, err) {
			return nil, t.fail(PhaseDecode, err)
		}
		// Nothing reached the caller and P's handle may be spent or
		// stale: run the whole turn again as a plain miss.
		if ent != nil {
			t.r.stats.hitRetries.Add(1)
			t.miss(MissRetry)
		}
		ent = nil
		t.avoidP = append(t.avoidP, pURL)
	}
}

// turn is the state of one Do call.
type turn struct {
	r     *Router
	req   *Request
	id    string // the request id the client sees: its own, or a generated one
	legID string // the X-Request-Id of every engine request of the turn (TurnRecord.EngineRequestID)
	start time.Time
	rec   TurnRecord
	done  bool

	hint   string     // ConversationHint, for placement only
	cands  Candidates // what the Identifier's Lookup found, for Verify and Key
	pDone  time.Time  // when P answered the last prefill leg
	avoidP []string   // prefill engines of legs a redo abandoned
	// badP are prefill engines this turn must not use again: their prefill
	// computed other prompt tokens than the render said, after pulling
	// the attached KV, which their prefix cache may now hold under the
	// tokens they computed.
	badP []string
	// renderEP is the prefill engine that rendered the prompt, where the
	// prefill leg that carries the handle goes; verified are the tokens
	// the handle's fingerprint was compared with.
	renderEP *endpoint
	verified []uint32
	// entKey and entAge are the store key and age of the attached handle,
	// to put it back when no prefill leg can take it.
	entKey string
	entAge time.Duration
	// bg is the prompt's background render, for APIs without token ids.
	bg         *bgRender
	avoidD     []string // decode engines that failed this turn
	decodeLegs int      // decode legs started
	// decodeTimeouts counts the decode legs that timed out (againAfter).
	decodeTimeouts int

	// Token verification: whether the decode leg asked for token ids on
	// the client's behalf (they are then stripped from the answer) or the
	// client asked itself, the ids D's answer carried, and the prompt's
	// tokens once rendered.
	idsAdded, idsAsked bool
	promptIDs, genIDs  []uint32
	hasIDs             bool
	rendered           []uint32
	renderedPooled     bool     // rendered came from the Router's id pool
	streamIDs          []uint32 // the pooled slice a stream's capture parses the prompt's ids into
	// renderText is the text of the render answer's id array (rendered's
	// source), in renderBuf, the pooled answer, until D's first event was
	// compared with it; renderInStream says a streaming Response took it,
	// which then releases it (from Next: Close may run on another
	// goroutine).
	renderBuf, renderText []byte
	renderInStream        bool
	// expanded is the retained handle taken, expanded into a pooled
	// buffer from its compacted form, returned when the turn ends.
	expanded []byte
	// fpPrefix is the fingerprint chain over the prefix of the prompt's
	// tokens that verification matched; its ids alias them (rendered),
	// so it is dropped when the turn ends.
	fpPrefix fingerprint.Prefix

	// The turn's own state, which the TurnRecord only reports: whether
	// a retained handle is attached, whether D prefills locally (P gave no
	// handle), whether the client streams, and the decode engine of the
	// last decode leg.
	hit   bool
	local bool
	// tokPrompt and tokVerified are the new prompt's length and the
	// prefix the handle's fingerprint matched, when tokens verified it.
	tokPrompt, tokVerified int
	stream                 bool
	decodeURL              string
	hdr                    http.Header // legHeader's, shared by the turn's legs: read-only

	trace turnTrace

	// The path a Chooser took (WithDecodeLocal): whether it was asked,
	// its choice, the decode engine of a decode-local turn, and when the
	// last decode leg was sent.
	chose   bool
	choice  threshold.Choice
	localEP *endpoint
	dSent   time.Time
}

func (r *Router) newTurn(req *Request) *turn {
	t := &turn{r: r, req: req, start: r.cfg.clock()}
	if req.Header == nil {
		req.Header = http.Header{}
	}
	t.id = req.Header.Get(headerRequestID)
	t.legID = t.id
	switch {
	case !validRequestID(t.id):
		// Absent, too long or not visible ASCII: never echoed, forwarded
		// or logged.
		t.id = newRequestID()
		t.legID = t.id
	default:
		// The client's id, made unique for the engines: two clients that
		// chose the same id never share one on an engine.
		t.legID = engineRequestID(t.id)
	}
	t.rec.RequestID = t.id
	t.rec.EngineRequestID = t.legID
	t.rec.Path = req.Path
	t.rec.CachedTokens = -1
	// Reuse stays "" until the lookup: a turn that fails before it is no
	// reuse miss.
	return t
}

// MaxRequestIDBytes bounds a client's X-Request-Id. An id that is longer,
// empty, or holds anything but visible ASCII (0x21 to 0x7e) is ignored: the
// router generates its own for both legs, the response and the TurnRecord.
const MaxRequestIDBytes = 128

func validRequestID(id string) bool {
	if id == "" || len(id) > MaxRequestIDBytes {
		return false
	}
	for i := 0; i < len(id); i++ {
		if id[i] < 0x21 || id[i] > 0x7e {
			return false
		}
	}
	return true
}

func newRequestID() string {
	var b [16]byte
	_, _ = rand.Read(b[:])
	return "bidikv-" + hex.EncodeToString(b[:])
}

// engineRequestID is the id a turn's legs carry for a client's id: the
// client's, for correlation, and 64 random bits.
func engineRequestID(client string) string {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return client + "-" + hex.EncodeToString(b[:])
}

func (t *turn) since() time.Duration { return t.r.cfg.clock().Sub(t.start) }

// fail ends the turn with err and reports it.
func (t *turn) fail(phase Phase, err error) error {
	t.rec.Err = err
	t.rec.ErrPhase = phase
	t.r.stats.failures.Add(1)
	t.finish()
	return err
}

// finish reports the turn once.
func (t *turn) finish() {
	if t.done {
		return
	}
	t.done = true
	t.rec.Total = t.since()
	t.choice.Release()
	if t.bg != nil {
		t.bg.abandon()
	}
	t.observe()
	if t.r.cfg.observer != nil {
		t.r.cfg.observer.ObserveTurn(&t.rec)
	}
	t.endTurn()
	t.fpPrefix = fingerprint.Prefix{}
	if t.renderInStream {
		// A stream closed before its first data event: its capture may
		// still hold the text, so the buffer is left to the collector.
		t.renderBuf, t.renderText, t.renderInStream = nil, nil, false
	}
	t.releaseRenderText()
	if t.expanded != nil {
		t.r.bufs.Put(t.expanded)
		t.expanded = nil
	}
	// The capture took the rendered ids as the stream's prompt ids when
	// their text was the render answer's: one slice, returned once.
	promptIsRendered := fingerprint.SameIDs(t.promptIDs, t.rendered)
	if promptIsRendered {
		t.r.stats.renderedPromptIDs.Add(1)
	}
	if t.renderedPooled {
		t.r.ids.Put(t.rendered)
		t.rendered, t.renderedPooled = nil, false
	}
	if t.streamIDs != nil {
		// The capture parsed into it, or into a larger slice it grew
		// (returned too, and kept if of a class's size), or took the
		// rendered ids (returned above).
		t.r.promptIDs.Store(int64(min(len(t.promptIDs), maxStreamHint)))
		t.r.ids.Put(t.streamIDs)
		if !promptIsRendered && !bufpool.SameArray(t.promptIDs, t.streamIDs) {
			t.r.ids.Put(t.promptIDs)
		}
		t.streamIDs, t.promptIDs, t.genIDs = nil, nil, nil
	}
}

// lookup takes the retained handle this request continues, if any, and
// decides whether to attach it. A handle taken from the store but not
// attached (it fails verification, is below the threshold, its decode
// endpoint is gone, or cannot be
// cut to the verified prefix) is put back for its remaining retention
// time: a request never destroys a handle it does not use.
func (t *turn) lookup(ctx context.Context) *entry.Entry {
	r := t.r
	if !r.cfg.reuse {
		t.rec.Reuse = ReuseOff
		return nil
	}
	cands, err := r.ident.Lookup(t.req)
	t.cands = cands
	if err == nil {
		if t.badP = r.poison.avoid(cands.Keys, r.cfg.clock()); len(t.badP) > 0 {
			r.stats.avoidedEngineTurns.Add(1)
		}
	}
	if err != nil {
		r.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: identifier lookup failed", slog.String("request_id", t.id), slog.String("err", err.Error()))
		return t.miss(MissNoKey)
	}
	if len(cands.Keys) == 0 {
		// Nothing this request could continue: a first turn, however the
		// Identifier keys turns.
		return t.miss(MissNotFound)
	}
	for _, k := range cands.Keys {
		v, ok, err := r.handles.take(ctx, k, t.id)
		if err != nil {
			return t.miss(MissStoreError)
		}
		if !ok {
			continue
		}
		e, err := entry.Decode(v, &r.bufs)
		if err != nil {
			return t.miss(MissBadEntry)
		}
		if e.Expanded {
			// Put back when the turn ends: every use of the expanded
			// handle (the prefill body's kv_transfer_params, a cut) is a
			// copy made before Do returns.
			t.expanded = e.Handle
		}
		age := r.cfg.clock().Sub(e.Created)
		if age >= r.cfg.retentionTTL {
			return t.miss(MissExpired)
		}
		t.rec.HandleTokens = e.Tokens
		if e.Endpoint != "" && r.decode.find(e.Endpoint) == nil {
			// The decode engine that holds the blocks is gone: P's pull
			// would fail. Not attached; kept for another router that may
			// still list the engine, or for its return.
			r.stats.goneHandles.Add(1)
			t.putBack(ctx, k, &e, age)
			return t.miss(MissEndpointGone)
		}
		if reason := t.r.restarts.check(ctx, &e); reason != "" {
			if reason == MissRestarted {
				// Its blocks are gone: never attached, not kept.
				r.stats.restartedHandles.Add(1)
			} else {
				t.putBack(ctx, k, &e, age)
			}
			return t.miss(reason)
		}
		if reason := t.verify(ctx, &e); reason != "" {
			t.putBack(ctx, k, &e, age)
			return t.miss(reason)
		}
		t.rec.Reuse = ReuseHit
		t.hit = true
		t.rec.HandleAge = age
		t.entKey, t.entAge = k, age
		if t.choosePath(ctx, k, &e, age) {
			return nil
		}
		return &e
	}
	return t.miss(MissNotFound)
}

// verify decides whether e may be attached to this request and, for a
// verified prefix shorter than the handle, cuts e.Handle to it. It returns
// a Miss* reason, or "" to attach.
func (t *turn) verify(ctx context.Context, e *entry.Entry) MissReason {
	r := t.r
	if r.cfg.verification == VerifyTokens && e.FP != nil {
		t.rec.Verification = VerifyTokens
		// Skip the render call when no verified prefix could pay.
		if !r.policy.Reuse(threshold.Input{RemoteTokens: e.Tokens}) {
			return MissThreshold
		}
		toks, err := t.promptTokens(ctx)
		if err != nil {
			switch {
			case errors.Is(err, errNoRenderer):
				r.stats.tokenFallbacks.Add(1)
				r.log.once(ctx, "no_renderer", "kvroute: no engine serves /v1/chat/completions/render, /v1/completions/render or /tokenize for this request; reuse falls back to content verification (see WithVerification)")
			case errors.Is(err, errRenderSkipped):
				// Counted in Stats.RenderSkipped; the breaker or the
				// distrust logged why.
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
			return t.verifyContent(e)
		}
		t.verified = toks
		t.rec.PromptTokens = len(toks)
		cp, err := e.FP.VerifyPrefix(toks)
		if err != nil {
			return MissBadEntry
		}
		n := cp.Tokens()
		// The chain over the verified tokens, for this turn's own
		// fingerprint (D's blocks begin with the same prompt).
		t.fpPrefix = cp
		t.tokPrompt, t.tokVerified = len(toks), n
		t.rec.VerifiedTokens = n
		if n == 0 {
			return MissMismatch
		}
		t.rec.ReusableTokens = n
		if !r.policy.Reuse(threshold.Input{RemoteTokens: n}) {
			return MissThreshold
		}
		if n < e.Tokens {
			if r.cfg.blockSize == 0 {
				r.stats.partialRefused.Add(1)
				return MissPartialRefused
			}
			n -= n % r.cfg.blockSize // a block-aligned R' (fingerprint blocks may be smaller)
			h, err := kvhandle.Cut(e.Handle, n, r.cfg.blockSize)
			if err != nil || n == 0 {
				r.stats.partialRefused.Add(1)
				if err != nil {
					r.log.once(ctx, "partial:"+err.Error(), "kvroute: a handle cannot be read partially; such turns run as plain prefills",
						slog.String("reason", err.Error()))
				}
				return MissPartialRefused
			}
			t.rec.ReusableTokens = n
			if !r.policy.Reuse(threshold.Input{RemoteTokens: n}) {
				return MissThreshold
			}
			e.Handle, e.Tokens = h, n
			t.rec.Partial = true
			r.stats.partialHits.Add(1)
		}
		return ""
	}
	t.rec.Verification = VerifyContent
	return t.verifyContent(e)
}

// verifyContent checks e by the Identifier's content rules.
func (t *turn) verifyContent(e *entry.Entry) MissReason {
	t.rec.Verification = VerifyContent
	if !e.ContentOK {
		return MissUnverified
	}
	if !t.r.ident.Verify(t.req, t.cands, e.Check) {
		return MissMismatch
	}
	t.rec.ReusableTokens = e.Tokens
	if !t.r.policy.Reuse(threshold.Input{RemoteTokens: e.Tokens}) {
		return MissThreshold
	}
	return ""
}

// putBack returns a taken, unused entry to the store for the rest of its
// retention time.
func (t *turn) putBack(ctx context.Context, key string, e *entry.Entry, age time.Duration) {
	tokens := e.Tokens
	if t.rec.HandleTokens > 0 {
		tokens = t.rec.HandleTokens // before any cut to the verified prefix
	}
	t.r.handles.putBack(ctx, key, e, tokens, age, t.id)
}

func (t *turn) miss(reason MissReason) *entry.Entry {
	t.hit = false
	t.rec.Reuse = ReuseMiss
	t.rec.MissReason = reason
	return nil
}
