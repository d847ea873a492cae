package kvroute

import (
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
