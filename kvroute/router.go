package kvroute

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/distrust"
	"github.com/bidikv/bidikv/kvroute/internal/peertier"
	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/retention/budget"
	"github.com/bidikv/bidikv/sse"
	"github.com/bidikv/bidikv/threshold"
	"github.com/bidikv/bidikv/transport"
)

// Router runs turns of multi-turn conversations over prefill and decode
// engines, carrying decode handles from one turn to the next. A Router is
// safe for concurrent use.
type Router struct {
	cfg      config
	client   engineClient // the one client of the engines (legs.go)
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
	handles  handles          // the Store's side (store.go)
	renders  renderers        // the prefill engines' renderers (verify_tokens.go)
	restarts restarts         // the decode engines' processes (pressure.go)
	shapes   shapes           // the engines' block sizes (shape.go)
	meter    meter            // the one reader of the engines' /metrics (pressure.go)
	poison   distrust.Avoided // prefill engines conversations avoid (internal/distrust)
	mem      *decodeMemory    // decode memory management (memory.go)
	closers  []func() error

	closed atomic.Bool
	stats  counters

	learned learned // what turns showed of the engines (learned.go)

	bufs     buffers          // the pools every turn's buffers come from (handler.go)
	maxEvent sse.ReaderOption // sse.WithMaxEventSize(cfg.maxEventBytes), made once
}

// New returns a Router configured by opts. It validates every option and
// returns an error wrapping ErrInvalidConfig that names the option at fault.
// New does no network I/O.
func New(opts ...Option) (*Router, error) {
	cfg := defaultConfig()
	for _, o := range opts {
		o.apply(&cfg)
	}
	cfg.finish()
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
	logBuffering(&r.log, cfg.bufferStreams)
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
		r.selector = &LeastLoaded{MaxInFlight: defaultAffinityMaxInFlight}
	}
	r.renders = renderers{prefill: r.prefill, client: r.client, clock: cfg.clock, maxBody: cfg.maxBodyBytes, stats: &r.stats, log: &r.log}
	r.renders.bgCtx, r.renders.bgCancel = context.WithCancel(context.Background())
	r.meter = meter{client: r.client.Client, clock: cfg.clock, restarts: &r.restarts, shapes: &r.shapes}
	r.shapes = shapes{configured: cfg.blockSize, meter: &r.meter, clock: cfg.clock, stats: &r.stats, log: &r.log}
	r.restarts = restarts{decode: r.decode, meter: &r.meter, maxAge: cfg.restartCheck, clock: cfg.clock, stats: &r.stats, log: &r.log,
		forget: func(url string) { r.learned.forget(url); r.shapes.forget(r.decode.find(url)) }}
	if r.mem, err = newDecodeMemory(r); err != nil {
		return nil, fmt.Errorf("%w: WithDecodeMemory: %v", ErrInvalidConfig, err)
	}
	r.handles.mem = r.mem
	r.meter.mem = r.mem
	r.shapes.learnt = func(url string, size int) {
		if r.mem.cfg.on && r.mem.cfg.interval >= 0 {
			return // the pressure readings tell the ledger both
		}
		// The capacity stays the configured one (the management does not
		// read it); the block size counts the holds' blocks.
		r.mem.ledger.SetCapacity(url, budget.Capacity{BlockSize: size})
	}
	if r.mem.cfg.on {
		r.decode.press = r.mem.press
		r.mem.bg.run(r.mem.sweep) // the start-up reading, then the holds past their retention (store.go)
	} else if r.cfg.memory.journal != nil || r.mem.ledger.Given("WithJournal") {
		r.mem.bg.run(func(ctx context.Context) { syncLoop(ctx, r.mem) }) // the sweep's sync, alone (store.go)
	}
	r.closers = append([]func() error{r.renders.close, r.mem.close}, r.closers...)
	if stop := startProbes(r.hp, r.client.Client, r.prefill, r.decode); stop != nil {
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
	r.client = engineClient{upstream.New(transport.NewClient(rt), cfg.apiKey, cfg.clock)}
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
		bufs: &r.bufs.bytes, stats: &r.stats, log: &r.log}
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

// logger is the Router's logger (WithLogger): it never logs prompts,
// bodies or credentials, and a warning that would repeat on every turn is
// logged once per key.
type logger struct {
	*slog.Logger
	seen sync.Map // once's keys
}

// once logs msg at warning level the first time key is seen.
func (l *logger) once(ctx context.Context, key, msg string, attrs ...slog.Attr) {
	if _, loaded := l.seen.LoadOrStore(key, struct{}{}); loaded {
		return
	}
	l.LogAttrs(ctx, slog.LevelWarn, msg, attrs...)
}

// Defaults of DecodeMemory's management (Defaults().DecodeMemory).
const (
	defaultHighWatermark   = 0.9
	defaultMetricsInterval = 5 * time.Second
	defaultReleases        = 4
	defaultHeadroom        = 0.05
	defaultBudget          = 0.9
	defaultRoomRate        = 0.5
)

func resolveDecodeMemory(c *config) {
	m := c.decodeMemory
	c.positive("WithDecodeMemory", "KVBytesPerToken", m.KVBytesPerToken)
	c.positive("WithDecodeMemory", "Capacity", m.Capacity)
	c.positive("WithDecodeMemory", "Releases", int64(m.Releases))
	c.decodeLocal, c.kvBytesPerToken = m.Local, m.KVBytesPerToken
	c.bufferStreams = nil
	for _, p := range m.BufferStreams {
		a, ok := streamsynth.ForPath(p)
		switch {
		case p == PathResponses:
			c.fail("WithDecodeMemory", "BufferStreams: %s streams carry the handle on response.completed (vLLM PR #37424) and are never buffered", p)
		case !ok:
			c.fail("WithDecodeMemory", "BufferStreams: %q is not an API with a buffered stream; use %s, %s or %s", p, PathChatCompletions, PathCompletions, PathMessages)
		default:
			if c.bufferStreams == nil {
				c.bufferStreams = map[string]streamsynth.API{}
			}
			c.bufferStreams[p] = a
		}
	}
	switch {
	case m.Budget != m.Budget || m.Budget > 1: // NaN too
		c.fail("WithDecodeMemory", "Budget %v is above 1; use a share of the capacity in (0, 1], 0 for the default (%v) or a negative value to turn the management off", m.Budget, defaultBudget)
	case m.HighWatermark != m.HighWatermark || m.HighWatermark > 1:
		c.fail("WithDecodeMemory", "HighWatermark %v is above 1; use a share of the KV memory in (0, 1], 0 for the default (%v) or a negative value for never", m.HighWatermark, defaultHighWatermark)
	case m.RoomRate != m.RoomRate:
		c.fail("WithDecodeMemory", "RoomRate is NaN; use a share of the capacity a minute, 0 for the default (%v) or a negative value for no limit", defaultRoomRate)
	case m.Headroom != m.Headroom || m.Headroom >= 1:
		c.fail("WithDecodeMemory", "Headroom %v is not below 1; use a share of the capacity in (0, 1), 0 for the default (%v) or a negative value for none", m.Headroom, defaultHeadroom)
	case m.Ledger != nil && m.Budget > 0 && m.Ledger.Given("WithFraction"):
		c.fail("WithDecodeMemory", "Budget %v and the Ledger's own budget.WithFraction are both set; set one of them (a Ledger built without it takes Budget)", m.Budget)
	case m.CPUTierTokens > 0 && m.Budget < 0:
		c.fail("WithDecodeMemory", "CPUTierTokens needs the management on (its ledger records where each turn's KV is): Budget must not be negative")
	case m.CPUTierPort < 0 || m.CPUTierPort > 65535:
		c.fail("WithDecodeMemory", "CPUTierPort %d is not a port; use 0 for the default (%d)", m.CPUTierPort, peertier.DefaultPort)
	case m.Ledger != nil && m.Capacity != 0 && m.Ledger.Given("WithCapacity"):
		c.fail("WithDecodeMemory", "Capacity %d and the Ledger's own budget.WithCapacity are both set; set one of them (a Ledger built without it takes Capacity)", m.Capacity)
	}
	mem := memoryConfig{on: m.Budget >= 0, fraction: m.Budget, capacity: m.Capacity, ledger: m.Ledger, journal: m.Journal,
		watermark: m.HighWatermark, interval: m.MetricsInterval, releases: m.Releases, headroom: m.Headroom,
		roomRate: m.RoomRate, tier: peertier.Config{Tokens: m.CPUTierTokens, Port: m.CPUTierPort,
			Peers: maps.Clone(m.CPUTierPeers), PromptOnly: m.CPUTierPromptOnly}, tierFirst: m.CPUTierFirst}
	for u, hp := range m.CPUTierPeers {
		if !peertier.ValidPeer(hp) {
			c.fail("WithDecodeMemory", "CPUTierPeers[%q] = %q: want host:port", u, hp)
		}
	}
	if mem.roomRate == 0 {
		mem.roomRate = defaultRoomRate
	}
	if mem.headroom == 0 {
		mem.headroom = defaultHeadroom
	}
	if mem.fraction <= 0 {
		mem.fraction = defaultBudget
	}
	if mem.watermark == 0 {
		mem.watermark = defaultHighWatermark
	}
	if mem.interval == 0 {
		mem.interval = defaultMetricsInterval
	}
	if mem.releases == 0 {
		mem.releases = defaultReleases
	}
	c.memory = mem
}

// memoryConfig is DecodeMemory's management, resolved.
type memoryConfig struct {
	on        bool    // Budget not negative
	fraction  float64 // Budget, resolved
	capacity  int64
	ledger    *budget.Budget
	journal   budget.Journal
	watermark float64       // negative: never crowded
	interval  time.Duration // negative: no reads
	releases  int
	headroom  float64 // negative: no room made on arrival
	roomRate  float64 // negative: no limit
	tier      peertier.Config
	tierFirst bool // DecodeMemory.CPUTierFirst
}
