package kvroute

import (
	"fmt"
	"log/slog"
	"net/http"
	"time"

	"github.com/bidikv/bidikv/threshold"
	"github.com/bidikv/bidikv/transport"
)

// Defaults users reason about. Every option documents its own default too.
const (
	// DefaultRetentionTTL is how long a decode handle is kept after the
	// router saw the decode engine's answer: 30 s under the engines' default
	// decoder_kv_blocks_ttl, as vLLM's reference proxy does.
	DefaultRetentionTTL = 450 * time.Second
	// DefaultDecoderBlocksTTL is vLLM's default decoder_kv_blocks_ttl.
	DefaultDecoderBlocksTTL = 480 * time.Second
	// ExpiryGuard is how close to a handle's expiry a prefill engine declines
	// to read it (vLLM PR #47021). The retention TTL must leave at least this
	// margin under the decoder TTL.
	ExpiryGuard = 5 * time.Second
	// DefaultPrefillTimeout bounds the whole prefill leg (request and body).
	DefaultPrefillTimeout = 60 * time.Second
	// DefaultFirstByteTimeout bounds the wait for the decode engine's
	// response headers.
	DefaultFirstByteTimeout = 60 * time.Second
	// DefaultIdleTimeout bounds the gap between two reads of the decode
	// stream that return data.
	DefaultIdleTimeout = 120 * time.Second
	// DefaultBlockSize is the decode engines' KV block size assumed for
	// partial reads: vLLM's default --block-size on CUDA.
	DefaultBlockSize = 16
	// DefaultRenderTimeout bounds one call to an engine's render endpoint.
	DefaultRenderTimeout = 10 * time.Second
	// DefaultMaxBodyBytes bounds a request body accepted by ServeHTTP and a
	// non-streaming upstream body read by Do.
	DefaultMaxBodyBytes = 32 << 20
	// DefaultMaxEventBytes bounds one event of a decode stream (16 MiB): the
	// final chunk of a 1M-token context carries a kv_transfer_params of
	// 62,500 block ids in each of two KV groups (about 1 MB) and its token
	// ids.
	DefaultMaxEventBytes = 16 << 20
	// DefaultMaxEntryBytes bounds one retained entry (8 MiB, the default
	// value bound of retention.Memory and redisstore): a decode handle with
	// its token fingerprint (8 bytes per block) and the Identifier's check.
	// A 1M-token context with two KV groups needs about 1.6 MB.
	DefaultMaxEntryBytes = 8 << 20
	// DefaultMaxObjectMembers bounds the members of any object in a
	// request body: far above what the APIs' requests hold (a JSON schema's
	// properties, a logit_bias map), far below what an 18 MB body of
	// one-character members would make the router index.
	DefaultMaxObjectMembers = 10_000
)

// Option configures a Router. Options are created by the With* functions.
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	prefill, decode  []string
	store            Store
	retentionTTL     time.Duration
	decoderTTL       time.Duration
	threshold        int
	policy           threshold.Policy
	transport        http.RoundTripper
	retry            transport.RetryPolicy
	logger           *slog.Logger
	prefillTimeout   time.Duration
	firstByteTimeout time.Duration
	idleTimeout      time.Duration
	identifier       Identifier
	tenant           TenantFunc
	clock            func() time.Time
	apiKey           string
	maxBodyBytes     int64
	reuse            bool
	localFallback    bool
	observer         Observer
	tracer           Tracer
	selector         Selector
	lease            time.Duration // the prefill engines' kv_lease_duration
	decodeAttempts   int           // decode legs one turn may start
	verification     Verification
	blockSize        int
	renderTimeout    time.Duration
	maxEventBytes    int
	maxEntryBytes    int
	maxMembers       int
	decodeLocal      bool
	kvBytesPerToken  int64
	restartCheck     time.Duration // WithRestartCheck
	ends             endpointConfig
	errs             []error
}

func defaultConfig() config {
	return config{
		retentionTTL:     DefaultRetentionTTL,
		decoderTTL:       DefaultDecoderBlocksTTL,
		threshold:        threshold.DefaultThreshold,
		prefillTimeout:   DefaultPrefillTimeout,
		firstByteTimeout: DefaultFirstByteTimeout,
		idleTimeout:      DefaultIdleTimeout,
		maxBodyBytes:     DefaultMaxBodyBytes,
		reuse:            true,
		lease:            DefaultPrefillLease,
		decodeAttempts:   DefaultDecodeAttempts,
		verification:     VerifyTokens,
		blockSize:        DefaultBlockSize,
		renderTimeout:    DefaultRenderTimeout,
		maxEventBytes:    DefaultMaxEventBytes,
		maxEntryBytes:    DefaultMaxEntryBytes,
		restartCheck:     DefaultRestartCheck,
		maxMembers:       DefaultMaxObjectMembers,
		clock:            time.Now,
		ends:             defaultEndpointConfig(),
	}
}

func (c *config) fail(option, format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%w: %s: %s", ErrInvalidConfig, option, fmt.Sprintf(format, args...)))
}

// WithPrefill sets the prefill engines' base URLs ("http://10.0.0.5:8100",
// "10.0.0.5:8100", "[fd00::5]:8100"). At least one is required. Later calls
// append.
func WithPrefill(addrs ...string) Option {
	return optionFunc(func(c *config) { c.prefill = append(c.prefill, addrs...) })
}

// WithDecode sets the decode engines' base URLs, in the same forms as
// WithPrefill. At least one is required. Later calls append.
func WithDecode(addrs ...string) Option {
	return optionFunc(func(c *config) { c.decode = append(c.decode, addrs...) })
}

// WithStore sets where decode handles are retained between turns. The
// default is an in-memory retention.Memory with its default bounds. A nil
// store is an error.
func WithStore(s Store) Option {
	return optionFunc(func(c *config) {
		if s == nil {
			c.fail("WithStore", "store is nil")
			return
		}
		c.store = s
	})
}

// WithRetentionTTL sets how long a decode handle is kept, counted from the
// moment the router saw the decode engine finish. The default is
// DefaultRetentionTTL (450 s). It must be positive and at least ExpiryGuard
// shorter than the engines' decoder_kv_blocks_ttl (see
// WithDecoderBlocksTTL), or New fails.
func WithRetentionTTL(d time.Duration) Option {
	return optionFunc(func(c *config) { c.retentionTTL = d })
}

// WithDecoderBlocksTTL tells the router the decode engines'
// decoder_kv_blocks_ttl, used only to validate the retention TTL. The
// default is DefaultDecoderBlocksTTL (480 s, vLLM's default). It must be
// positive.
func WithDecoderBlocksTTL(d time.Duration) Option {
	return optionFunc(func(c *config) { c.decoderTTL = d })
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
// streams; see WithPrefillTimeout, WithFirstByteTimeout and WithIdleTimeout.
func WithTransport(rt http.RoundTripper) Option {
	return optionFunc(func(c *config) {
		if rt == nil {
			c.fail("WithTransport", "round tripper is nil")
			return
		}
		c.transport = rt
	})
}

// WithRetryPolicy sets how failed prefill legs are retried (attempts,
// backoff, the longest Retry-After honoured). The default is the zero
// transport.RetryPolicy: 3 attempts, backoff from 50 ms doubling to 1 s,
// Retry-After honoured up to 5 s. MaxAttempts 1 disables retries. Decode
// legs are never retried.
func WithRetryPolicy(p transport.RetryPolicy) Option {
	return optionFunc(func(c *config) { c.retry = p })
}

// WithLogger sets the logger. The default discards everything. The router
// never logs prompts, bodies or credentials.
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(c *config) { c.logger = l })
}

// WithPrefillTimeout bounds the prefill leg, from sending the request to
// reading P's whole answer. The default is DefaultPrefillTimeout (60 s); 0
// means no limit; negative is an error.
func WithPrefillTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.prefillTimeout = d })
}

// WithFirstByteTimeout bounds the wait for the decode engine's response
// headers. The default is DefaultFirstByteTimeout (60 s); 0 means no limit;
// negative is an error.
func WithFirstByteTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.firstByteTimeout = d })
}

// WithIdleTimeout bounds the gap between two stream reads from the decode
// engine. The default is DefaultIdleTimeout (120 s); 0 means no limit;
// negative is an error.
func WithIdleTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.idleTimeout = d })
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

// WithMaxBodyBytes bounds request bodies accepted by ServeHTTP (larger ones
// get 413) and non-streaming upstream bodies read by Do. The default is
// DefaultMaxBodyBytes (32 MiB); it must be positive.
func WithMaxBodyBytes(n int64) Option {
	return optionFunc(func(c *config) { c.maxBodyBytes = n })
}

// WithReuse turns bidirectional KV reuse on (the default) or off. Off, every
// turn is a plain P→D turn with the miss handle and no handle is retained:
// the one-way disaggregation baseline.
func WithReuse(on bool) Option {
	return optionFunc(func(c *config) { c.reuse = on })
}

// WithLocalPrefillFallback chooses what happens when the prefill engine
// answers without a handle. Off (the default), the turn fails with 502. On,
// the decode engine gets the client's request with no kv_transfer_params and
// prefills locally; the fallback is logged and reported to the Observer.
// The miss handle is never sent to a decode engine either way.
func WithLocalPrefillFallback(on bool) Option {
	return optionFunc(func(c *config) { c.localFallback = on })
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

// WithSelector sets how endpoints are chosen for each leg. The default sends
// decode to the engine holding the conversation's KV and otherwise to the
// least loaded engine.
func WithSelector(s Selector) Option {
	return optionFunc(func(c *config) {
		if s == nil {
			c.fail("WithSelector", "selector is nil")
			return
		}
		c.selector = s
	})
}

// Verification selects how the router proves that a retained handle's KV is
// the KV the next prompt needs. See WithVerification.
type Verification string

// The verification modes.
const (
	// VerifyTokens compares tokens: the decode leg asks the engine for token
	// ids (return_token_ids), a compact fingerprint of the sequence D's
	// blocks hold is kept with the handle, and before a prefill leg the new
	// prompt is rendered by an engine (POST .../render, or /tokenize) and
	// compared with it. Only the verified common prefix is attached. It is
	// exact: no answer can differ from a single engine's. The default.
	VerifyTokens Verification = "tokens"
	// VerifyContent compares content: a handle is used only when the request
	// resends exactly the stored conversation and reply (ContinuationKeys'
	// digests), and turns whose next render may differ (reasoning output,
	// stop strings, ...) are not retained. It needs no engine support, but it
	// cannot see what a chat template or tokenizer does to the text (see the
	// README's Limitations).
	VerifyContent Verification = "content"
)

// WithVerification sets how reuse is verified: VerifyTokens (the default)
// or VerifyContent. In token mode, a turn whose engine sends no token ids or
// serves no render endpoint falls back to content verification with all of
// its refusals; the fallback is logged once and counted in
// Stats.TokenFallbacks. Any other value is an error.
func WithVerification(v Verification) Option {
	return optionFunc(func(c *config) { c.verification = v })
}

// WithBlockSize tells the router the decode engines' KV block size (vLLM's
// --block-size), which token verification needs to attach only a verified
// prefix of a handle: remote_num_tokens is lowered to a multiple of it and
// every KV group's remote_block_ids is cut from the front. The default is
// DefaultBlockSize (16). 0 disables partial reads: a handle is then
// attached only when the new prompt begins with its whole sequence. A handle
// whose block count does not fit the size is never cut (counted in
// Stats.PartialRefused). Negative is an error.
func WithBlockSize(n int) Option {
	return optionFunc(func(c *config) { c.blockSize = n })
}

// WithRenderTimeout bounds one render call in token verification. The
// default is DefaultRenderTimeout (10 s); a call that times out makes the
// turn a plain prefill. It must be positive.
func WithRenderTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) { c.renderTimeout = d })
}

// WithMaxEventBytes bounds one event of a decode stream, in bytes. A
// longer event ends the stream with an error (an *UpstreamError in
// PhaseStream wrapping sse.ErrEventTooLarge) and nothing is retained. The
// default is DefaultMaxEventBytes (16 MiB); it must be positive.
func WithMaxEventBytes(n int) Option {
	return optionFunc(func(c *config) { c.maxEventBytes = n })
}

// WithMaxObjectMembers bounds the members of every object in a request
// body, at any depth (duplicate keys included). A body with a larger
// object is refused with 400 before the router indexes it, so that the
// memory a turn takes stays proportional to its body: the index of an
// object's members, and the members a content digest collects and sorts,
// cost tens of bytes per member, which a body of one-character members
// would multiply by up to 60. The default is DefaultMaxObjectMembers
// (10,000); it must be positive.
func WithMaxObjectMembers(n int) Option {
	return optionFunc(func(c *config) { c.maxMembers = n })
}

// WithMaxEntryBytes bounds one retained entry (the decode handle, its token
// fingerprint and the Identifier's check), in bytes. A larger one is not
// retained (TurnRecord.StoreRefusal "handle_too_large", Stats.TooLarge; logged
// once). It also sizes the values of the default in-memory store; a Store
// passed with WithStore keeps its own bound (a Put it refuses with an error
// wrapping retention.ErrTooLarge is counted the same way). The default is
// DefaultMaxEntryBytes (8 MiB); it must be positive.
func WithMaxEntryBytes(n int) Option {
	return optionFunc(func(c *config) { c.maxEntryBytes = n })
}

// WithDecodeLocal lets a turn whose retained handle was verified by tokens
// run decode-local (package doc, Decode-local turns): as a plain request to
// the decode engine that holds the conversation, which computes only the
// new suffix from its own prefix cache. The WithThresholdPolicy policy
// decides per turn when it is a threshold.Chooser (threshold.CostModel is
// one); otherwise a threshold.CostModel with its defaults and WithThreshold
// does. Turn it on only when the decode engines run with prefix caching
// (vLLM's default, --enable-prefix-caching): the router cannot see it, and
// a decode engine without it recomputes the whole prompt (the answer is
// still right, but slow, until the cost model learns it). The decode-local
// leg goes to the engine that holds the handle, whatever the Selector
// would pick; when that engine is ejected the turn pulls as usual. A
// learning Chooser (threshold.Learner) is told each streaming turn's
// observed times on the router's clock. Default false.
func WithDecodeLocal(on bool) Option {
	return optionFunc(func(c *config) { c.decodeLocal = on })
}

// WithKVBytesPerToken sets the bytes of KV one token takes on the decode
// engines (layers × KV heads × head dim × 2 × dtype bytes), for
// DecodeKV.Bytes. Default 0: unknown, Bytes stays 0. Negative is invalid.
func WithKVBytesPerToken(n int64) Option {
	return optionFunc(func(c *config) { c.kvBytesPerToken = n })
}

func (c *config) validate() {
	if c.kvBytesPerToken < 0 {
		c.fail("WithKVBytesPerToken", "%d is negative; use 0 when unknown", c.kvBytesPerToken)
	}
	switch c.verification {
	case VerifyTokens, VerifyContent:
	default:
		c.fail("WithVerification", "%q is not a mode; use kvroute.VerifyTokens or kvroute.VerifyContent", c.verification)
	}
	if c.blockSize < 0 {
		c.fail("WithBlockSize", "%d is negative; use 0 to disable partial reads", c.blockSize)
	}
	if c.renderTimeout <= 0 {
		c.fail("WithRenderTimeout", "%v is not positive", c.renderTimeout)
	}
	if c.restartCheck < 0 {
		c.fail("WithRestartCheck", "%v is negative; use 0 to turn the reads of /metrics off", c.restartCheck)
	}
	c.validateEndpoints()
	if len(c.prefill)+len(c.ends.prefill) == 0 {
		c.fail("WithPrefill", "no prefill endpoint; pass at least one URL")
	}
	if len(c.decode)+len(c.ends.decode) == 0 {
		c.fail("WithDecode", "no decode endpoint; pass at least one URL")
	}
	if c.decoderTTL <= 0 {
		c.fail("WithDecoderBlocksTTL", "%v is not positive", c.decoderTTL)
	}
	switch {
	case c.retentionTTL <= 0:
		c.fail("WithRetentionTTL", "%v is not positive", c.retentionTTL)
	case c.decoderTTL > 0 && c.retentionTTL > c.decoderTTL-ExpiryGuard:
		c.fail("WithRetentionTTL", "%v leaves less than %v under the engines' decoder_kv_blocks_ttl of %v; use at most %v (or raise WithDecoderBlocksTTL to match the engines)",
			c.retentionTTL, ExpiryGuard, c.decoderTTL, c.decoderTTL-ExpiryGuard)
	}
	if c.threshold < 0 {
		c.fail("WithThreshold", "%d is negative; use 0 to disable the check", c.threshold)
	}
	for _, d := range []struct {
		name string
		v    time.Duration
	}{{"WithPrefillTimeout", c.prefillTimeout}, {"WithFirstByteTimeout", c.firstByteTimeout}, {"WithIdleTimeout", c.idleTimeout}} {
		if d.v < 0 {
			c.fail(d.name, "%v is negative; use 0 for no limit", d.v)
		}
	}
	if c.maxBodyBytes <= 0 {
		c.fail("WithMaxBodyBytes", "%d is not positive", c.maxBodyBytes)
	}
	if c.maxEventBytes <= 0 {
		c.fail("WithMaxEventBytes", "%d is not positive (default %d)", c.maxEventBytes, DefaultMaxEventBytes)
	}
	if c.maxEntryBytes <= 0 {
		c.fail("WithMaxEntryBytes", "%d is not positive (default %d)", c.maxEntryBytes, DefaultMaxEntryBytes)
	}
	if c.maxMembers <= 0 {
		c.fail("WithMaxObjectMembers", "%d is not positive (default %d)", c.maxMembers, DefaultMaxObjectMembers)
	}
}
