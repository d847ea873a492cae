package kvroute

import (
	"context"
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
	"github.com/bidikv/bidikv/threshold"
	"github.com/bidikv/bidikv/transport"
)

// Every option and its default is in this file or in options_*.go, by
// group. New applies the options in order, then resolves the grouped ones
// (a zero field keeps its default) and validates the whole configuration
// once: every problem is an error wrapping ErrInvalidConfig that names the
// option and the field, and nothing is clamped silently.

// expiryGuard is how close to a handle's expiry a prefill engine declines
// to read it (vLLM PR #47021). The retention TTL must leave at least this
// margin under the decoder TTL, and a decode leg is sent with P's handle
// only while at least this much of P's lease is left.
const expiryGuard = 5 * time.Second

// Option configures a Router. Options are created by the With* functions.
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

// config is the Router's configuration: the effective values, once New
// has resolved the grouped options.
type config struct {
	prefill, decode []string
	store           Store
	threshold       int
	policy          threshold.Policy
	transport       http.RoundTripper
	logger          *slog.Logger
	identifier      Identifier
	tenant          TenantFunc
	clock           func() time.Time
	apiKey          string
	reuse           bool
	observer        Observer
	tracer          Tracer
	selector        Selector

	// The grouped options as given (options_*.go), resolved into the
	// fields below them by finish.
	ttls         TTLs
	timeouts     Timeouts
	limits       Limits
	failover     Failover
	health       Health
	verify       Verification
	decodeMemory DecodeMemory

	retentionTTL, decoderTTL, lease                              time.Duration
	prefillTimeout, firstByteTimeout, idleTimeout, renderTimeout time.Duration
	bufferedTimeout                                              time.Duration
	maxBodyBytes                                                 int64
	maxEventBytes, maxEntryBytes, maxMembers                     int
	retry                                                        transport.RetryPolicy
	decodeAttempts                                               int
	localFallback                                                bool
	ends                                                         endpointConfig
	restartCheck                                                 time.Duration
	verification                                                 VerificationMode
	blockSize                                                    int  // WithVerification's BlockSize; 0: none
	noPartial                                                    bool // WithVerification's BlockSize < 0
	decodeLocal                                                  bool
	kvBytesPerToken                                              int64
	bufferStreams                                                map[string]streamsynth.API // by path
	memory                                                       memoryConfig

	errs []error
}

// Settings are the values of the grouped options.
type Settings struct {
	TTLs         TTLs
	Timeouts     Timeouts
	Limits       Limits
	Failover     Failover
	Health       Health
	Verification Verification
	DecodeMemory DecodeMemory
}

// Defaults returns what New takes for a grouped option's zero field: every
// default of the grouped options, in one place (a program that exposes
// them as flags shows these).
func Defaults() Settings {
	return Settings{
		TTLs:         TTLs{Retention: 450 * time.Second, DecoderBlocks: 480 * time.Second, PrefillLease: 30 * time.Second},
		Timeouts:     Timeouts{Prefill: 60 * time.Second, FirstByte: 60 * time.Second, Idle: 120 * time.Second, Render: 10 * time.Second, Buffered: 10 * time.Minute},
		Limits:       Limits{Body: 32 << 20, Event: 16 << 20, Entry: 8 << 20, ObjectMembers: 10_000},
		Failover:     Failover{DecodeAttempts: 3},
		Health:       Health{EjectAfter: 3, EjectBackoff: time.Second, MaxEjectBackoff: 30 * time.Second, RestartCheck: time.Second},
		Verification: Verification{Mode: VerifyTokens},
		DecodeMemory: DecodeMemory{Budget: defaultBudget, HighWatermark: defaultHighWatermark,
			MetricsInterval: defaultMetricsInterval, Releases: defaultReleases, Headroom: defaultHeadroom, RoomRate: defaultRoomRate},
	}
}

// defaultConfig is the configuration before any option.
func defaultConfig() config {
	d := Defaults()
	return config{
		threshold: threshold.DefaultThreshold,
		reuse:     true,
		clock:     time.Now,
		ttls:      d.TTLs,
		timeouts:  d.Timeouts,
		limits:    d.Limits,
		health:    d.Health,
		verify:    d.Verification,
		failover:  d.Failover,
	}
}

// fail records a problem with option, whose message says what is wrong
// and what to use.
func (c *config) fail(option, format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%w: %s: %s", ErrInvalidConfig, option, fmt.Sprintf(format, args...)))
}

// finish resolves the grouped options and validates the configuration,
// after every option was applied.
func (c *config) finish() {
	resolveTTLs(c)
	resolveTimeouts(c)
	resolveLimits(c)
	resolveFailover(c)
	resolveHealth(c)
	resolveVerification(c)
	resolveDecodeMemory(c)
	if c.decodeLocal && c.verification != VerifyTokens {
		// A turn goes decode-local only with a handle verified by tokens:
		// in any other mode the option would silently do nothing.
		c.fail("WithDecodeMemory", "Local needs WithVerification's Mode VerifyTokens (the default), not %q: a turn goes decode-local only with a handle verified by tokens", c.verification)
	}
	if len(c.prefill)+len(c.ends.prefill) == 0 {
		c.fail("WithPrefill", "no prefill endpoint; pass at least one URL")
	}
	if len(c.decode)+len(c.ends.decode) == 0 {
		c.fail("WithDecode", "no decode endpoint; pass at least one URL")
	}
	if c.threshold < 0 {
		c.fail("WithThreshold", "%d is negative; use 0 to disable the check", c.threshold)
	}
}

// positive reports a problem with a grouped option's field that must be
// positive when set: negative values have no meaning there.
func (c *config) positive(option, field string, v int64) {
	if v < 0 {
		c.fail(option, "%s %d is negative; use 0 for the default", field, v)
	}
}

// WithPrefill sets the prefill engines' base URLs ("http://10.0.0.5:8100",
// "10.0.0.5:8100", "[fd00::5]:8100"). At least one prefill endpoint is
// required, from this option or WithEndpoints. Later calls append.
func WithPrefill(addrs ...string) Option {
	return optionFunc(func(c *config) { c.prefill = append(c.prefill, addrs...) })
}

// WithDecode sets the decode engines' base URLs, in the same forms as
// WithPrefill. At least one decode endpoint is required, from this option
// or WithEndpoints. Later calls append.
func WithDecode(addrs ...string) Option {
	return optionFunc(func(c *config) { c.decode = append(c.decode, addrs...) })
}

// WithEndpoints adds endpoints of phase (PhasePrefill or PhaseDecode) with
// a data-parallel rank (sent as X-Data-Parallel-Rank) or a weight; see
// transport.Endpoint. It combines with WithPrefill and WithDecode; a zero
// weight means 1. Router.SetEndpoints replaces them at run time.
func WithEndpoints(phase Phase, eps ...transport.Endpoint) Option {
	return optionFunc(func(c *config) {
		switch phase {
		case PhasePrefill:
			c.ends.prefill = append(c.ends.prefill, eps...)
		case PhaseDecode:
			c.ends.decode = append(c.ends.decode, eps...)
		default:
			c.fail("WithEndpoints", "phase %q is neither %q nor %q", phase, PhasePrefill, PhaseDecode)
		}
	})
}

// WithStore sets where decode handles are retained between turns. The
// default is an in-memory retention.Memory with its default bounds and the
// value bound of WithLimits' Entry. A nil store is an error.
func WithStore(s Store) Option {
	return optionFunc(func(c *config) {
		if s == nil {
			c.fail("WithStore", "store is nil")
			return
		}
		c.store = s
	})
}

// WithThreshold sets the recompute threshold of the default reuse policy,
// mirroring the engines' kv_recompute_threshold: a retained handle is
// attached only when at least n tokens can be pulled. The default is 64; 0
// disables the check (any reusable token is worth a pull); a negative n is
// an error. WithThresholdPolicy overrides it.
func WithThreshold(n int) Option {
	return optionFunc(func(c *config) { c.threshold = n })
}

// WithThresholdPolicy sets the reuse decision. The default is
// threshold.Engine with the WithThreshold value. A nil policy is an error.
func WithThresholdPolicy(p threshold.Policy) Option {
	return optionFunc(func(c *config) {
		if p == nil {
			c.fail("WithThresholdPolicy", "policy is nil")
			return
		}
		c.policy = p
	})
}

// WithTransport sets the round tripper for upstream requests, wrapped in a
// client with no overall timeout. The default is transport.NewTransport().
//
// Upstream requests never use a client-wide timeout, which would cut long
// streams; see WithTimeouts.
func WithTransport(rt http.RoundTripper) Option {
	return optionFunc(func(c *config) {
		if rt == nil {
			c.fail("WithTransport", "round tripper is nil")
			return
		}
		c.transport = rt
	})
}

// WithLogger sets the logger. The default discards everything. The router
// never logs prompts, bodies or credentials.
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(c *config) { c.logger = l })
}

// WithIdentifier sets how turns map to retention keys. The default is
// ContinuationKeys, which needs no client cooperation.
func WithIdentifier(id Identifier) Option {
	return optionFunc(func(c *config) {
		if id == nil {
			c.fail("WithIdentifier", "identifier is nil")
			return
		}
		c.identifier = id
	})
}

// WithTenant sets the function that scopes retained handles: identical
// histories from two tenants never share a handle. The default is
// PrincipalTenant (a digest of the request's principal, Request.Principal,
// and cache_salt).
func WithTenant(f TenantFunc) Option {
	return optionFunc(func(c *config) {
		if f == nil {
			c.fail("WithTenant", "tenant function is nil")
			return
		}
		c.tenant = f
	})
}

// WithClock sets the router's clock, used for handle ages and retention
// deadlines. The default is time.Now.
func WithClock(now func() time.Time) Option {
	return optionFunc(func(c *config) {
		if now == nil {
			c.fail("WithClock", "clock is nil")
			return
		}
		c.clock = now
	})
}

// WithUpstreamAPIKey sets the bearer token sent to the engines (vLLM's
// --api-key). The default sends none; the client's own Authorization header
// is never forwarded.
func WithUpstreamAPIKey(key string) Option {
	return optionFunc(func(c *config) { c.apiKey = key })
}

// WithReuse turns bidirectional KV reuse on (the default) or off. Off, every
// turn is a plain P→D turn with the miss handle and no handle is retained:
// the one-way disaggregation baseline.
func WithReuse(on bool) Option {
	return optionFunc(func(c *config) { c.reuse = on })
}

// WithObserver sets the receiver of one TurnRecord per turn. The default
// observes nothing.
func WithObserver(o Observer) Option {
	return optionFunc(func(c *config) {
		if o == nil {
			c.fail("WithObserver", "observer is nil")
			return
		}
		c.observer = o
	})
}

// WithSelector sets how endpoints are chosen for each leg. The default is
// &LeastLoaded{MaxInFlight: 64}: decode to the engine holding the
// conversation's KV, and otherwise to the least loaded engine.
func WithSelector(s Selector) Option {
	return optionFunc(func(c *config) {
		if s == nil {
			c.fail("WithSelector", "selector is nil")
			return
		}
		c.selector = s
	})
}

// WithTracer sets the Tracer that follows each turn. The default traces
// nothing and costs nothing: no span, no context, no header; the client's
// own trace headers (traceparent, tracestate) reach the engines as sent.
func WithTracer(tr Tracer) Option {
	return optionFunc(func(c *config) {
		if tr == nil {
			c.fail("WithTracer", "tracer is nil")
			return
		}
		c.tracer = tr
	})
}

// Limits bound the bytes a turn takes, so that its memory follows what the
// client and the engines actually sent (docs/kvroute.md, Memory).
type Limits struct {
	// Body bounds a request body accepted by ServeHTTP (a larger one gets
	// 413) and a non-streaming upstream body read by Do (default 32 MiB).
	Body int64
	// Event bounds one event of a decode stream (default 16 MiB: the final
	// chunk of a 1M-token context carries a kv_transfer_params of 62,500
	// block ids in each of two KV groups, about 1 MB, and its token ids).
	// A longer event ends the stream with an error (an *UpstreamError in
	// PhaseStream wrapping sse.ErrEventTooLarge) and nothing is retained.
	Event int
	// Entry bounds one retained entry: the decode handle, its token
	// fingerprint and the Identifier's check (default 8 MiB, also the
	// value bound of the default store; a 1M-token context with two KV
	// groups needs about 1.6 MB). A larger one is not retained
	// (TurnRecord.StoreRefusal "handle_too_large", Stats.TooLarge; logged
	// once). A Store passed with WithStore keeps its own bound; a Put it
	// refuses with an error wrapping retention.ErrTooLarge is counted the
	// same way.
	Entry int
	// ObjectMembers bounds the members of every object in a request body,
	// at any depth, duplicate keys included (default 10,000: far above
	// what the APIs' requests hold, such as a JSON schema's properties or
	// a logit_bias map, far below what an 18 MB body of one-character
	// members would make the router index). A body with a larger object is
	// refused with 400 before the router indexes it, so that the memory a
	// turn takes stays proportional to its body.
	ObjectMembers int
	// ChargeAnswer, when set, is charged the bytes of every decode answer
	// the router holds in memory: a non-streaming answer, and a buffered
	// stream's (WithDecodeMemory's BufferStreams); a stream passed through
	// is not held and not charged. It is called with the turn's context
	// and n > 0 bytes, before they are held: the answer's Content-Length
	// at once when the engine declares one, else each read's bytes as
	// they arrive; it reports whether they fit. When they do not, the
	// answer is dropped (its decode engine keeps a hold it made until its
	// TTL) and the turn fails with an error HTTPStatus maps to 503, with
	// RetryAfter's default, and is not redone. Everything charged to a
	// turn is given back once, as one call with the negated total, when
	// the answer is dropped or the Response closed. Nil (the default):
	// answers are bounded by Body alone.
	ChargeAnswer func(ctx context.Context, n int64) bool
}

// WithLimits sets the limits. A zero field keeps its default
// (Defaults); a negative one is an error.
func WithLimits(l Limits) Option {
	return optionFunc(func(c *config) { c.limits = l })
}

func resolveLimits(c *config) {
	d, l := Defaults().Limits, c.limits
	c.positive("WithLimits", "Body", l.Body)
	c.positive("WithLimits", "Event", int64(l.Event))
	c.positive("WithLimits", "Entry", int64(l.Entry))
	c.positive("WithLimits", "ObjectMembers", int64(l.ObjectMembers))
	c.maxBodyBytes = orDefault(l.Body, d.Body)
	c.maxEventBytes = orDefault(l.Event, d.Event)
	c.maxEntryBytes = orDefault(l.Entry, d.Entry)
	c.maxMembers = orDefault(l.ObjectMembers, d.ObjectMembers)
}

// Health is how the router learns that an endpoint is failing and that a
// decode engine restarted: passive ejection after consecutive failures,
// active probes, and reads of a decode engine's process start.
type Health struct {
	// EjectAfter is how many consecutive failed requests (connection
	// errors, timeouts, 5xx answers, broken streams) eject an endpoint
	// from selection (default 3; negative: never). An ejected endpoint is
	// left out for an exponential backoff from EjectBackoff (default 1 s)
	// doubling up to MaxEjectBackoff (default 30 s), with jitter. When the
	// time is up it is tried again; a success re-admits it and resets the
	// backoff, a failure ejects it for the next interval. When every
	// endpoint of a phase is ejected, selection falls back to all of them.
	EjectAfter                    int
	EjectBackoff, MaxEjectBackoff time.Duration
	// ProbeInterval turns on active health checking (default 0: no
	// probes): every interval, each endpoint gets GET /health (with its
	// rank header), bounded by ProbeTimeout (0: the interval). A 200
	// re-admits an ejected endpoint at once; any other answer counts as a
	// failure. The probes run on one goroutine that Close stops.
	ProbeInterval, ProbeTimeout time.Duration
	// RestartCheck is how old the router's reading of a decode engine's
	// process_start_time_seconds (GET /metrics) may be when it attaches
	// one of the engine's handles (default 1 s); an older one is read
	// again first, on the turn's lookup, at most once per interval per
	// engine (concurrent turns share the read). A handle issued before
	// the engine's current process started is never attached (docs/kvroute.md,
	// Failure paths). Negative turns the reads off: restarts are then
	// noticed only by a new engine id in the engine's handles or by a
	// failure to reach it, so an engine with a fixed engine id that
	// restarts between two turns without the router seeing it fail is not
	// noticed.
	RestartCheck time.Duration
}

// WithHealth sets how endpoint health and decode engine restarts are
// tracked. A zero field keeps its default (Defaults); a negative
// EjectAfter disables ejection, a negative ProbeInterval probes nothing, a
// negative RestartCheck turns the reads of /metrics off; other negative
// fields are errors.
func WithHealth(h Health) Option {
	return optionFunc(func(c *config) { c.health = h })
}

// endpointConfig is the resolved Health and the endpoints of WithEndpoints.
type endpointConfig struct {
	prefill, decode []transport.Endpoint
	ejectAfter      int
	ejectBackoff    time.Duration
	maxEjectBackoff time.Duration
	probeInterval   time.Duration
	probeTimeout    time.Duration
}

func resolveHealth(c *config) {
	d, h, e := Defaults().Health, c.health, &c.ends
	c.positive("WithHealth", "EjectBackoff", int64(h.EjectBackoff))
	c.positive("WithHealth", "MaxEjectBackoff", int64(h.MaxEjectBackoff))
	c.positive("WithHealth", "ProbeTimeout", int64(h.ProbeTimeout))
	e.ejectAfter = max(orDefault(h.EjectAfter, d.EjectAfter), 0)
	e.ejectBackoff = orDefault(h.EjectBackoff, d.EjectBackoff)
	e.maxEjectBackoff = orDefault(h.MaxEjectBackoff, d.MaxEjectBackoff)
	e.probeInterval = max(h.ProbeInterval, 0)
	e.probeTimeout = h.ProbeTimeout
	c.restartCheck = orNone(h.RestartCheck, d.RestartCheck)
	if e.ejectAfter > 0 && e.maxEjectBackoff < e.ejectBackoff {
		c.fail("WithHealth", "MaxEjectBackoff %v is shorter than EjectBackoff %v", e.maxEjectBackoff, e.ejectBackoff)
	}
}
