package kvroute

import (
	"context"
	"errors"
	"io"
	"net/http"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/bidikv/bidikv/transport"
)

// Defaults of endpoint health.
const (
	// DefaultEjectAfter is how many consecutive failures eject an endpoint.
	DefaultEjectAfter = 3
	// DefaultEjectBackoff is how long an endpoint stays ejected the first
	// time; each ejection that follows a failed re-admission doubles it.
	DefaultEjectBackoff = time.Second
	// DefaultMaxEjectBackoff caps the ejection time.
	DefaultMaxEjectBackoff = 30 * time.Second
	// DefaultPrefillLease is vLLM's default kv_lease_duration: how long a
	// prefill engine holds its blocks for a decode engine that has not
	// read them.
	DefaultPrefillLease = 30 * time.Second
	// DefaultDecodeAttempts is how many decode legs a turn may start.
	DefaultDecodeAttempts = 3
)

// EndpointEvent is a change of an endpoint's state.
type EndpointEvent struct {
	Phase    Phase  // PhasePrefill or PhaseDecode
	Endpoint string // the endpoint's URL, with " (rank N)" when pinned
	Kind     EndpointEventKind
	// Failures is the count of consecutive failures (EndpointEjected).
	Failures int
	// Until is when an ejected endpoint becomes eligible again.
	Until time.Time
	// Err is the failure that ejected it; it never holds request content.
	Err error
}

// EndpointObserver is an optional interface of an Observer (WithObserver):
// when the Observer implements it, the router reports endpoint ejections,
// re-admissions, additions and removals. ObserveEndpoint is called
// synchronously and must not block.
type EndpointObserver interface {
	ObserveEndpoint(ev EndpointEvent)
}

// EndpointStatus is a snapshot of one endpoint, from Router.Endpoints.
type EndpointStatus struct {
	Endpoint transport.Endpoint
	// URL identifies the endpoint as Candidate.URL does.
	URL      string
	InFlight int
	// Healthy reports whether selection considers it (not ejected, or its
	// ejection has run out).
	Healthy bool
	// Failures counts consecutive failures.
	Failures int
	// EjectedUntil is the end of the current or last ejection.
	EjectedUntil time.Time
}

// endpointConfig holds the options of this file.
type endpointConfig struct {
	prefill, decode []transport.Endpoint
	ejectAfter      int
	ejectBackoff    time.Duration
	maxEjectBackoff time.Duration
	probeInterval   time.Duration
	probeTimeout    time.Duration
}

func defaultEndpointConfig() endpointConfig {
	return endpointConfig{
		ejectAfter:      DefaultEjectAfter,
		ejectBackoff:    DefaultEjectBackoff,
		maxEjectBackoff: DefaultMaxEjectBackoff,
	}
}

func (c *config) validateEndpoints() {
	e := &c.ends
	if e.ejectAfter < 0 {
		c.fail("WithEjection", "failures %d is negative; use 0 to disable ejection", e.ejectAfter)
	}
	if e.ejectAfter > 0 && (e.ejectBackoff <= 0 || e.maxEjectBackoff < e.ejectBackoff) {
		c.fail("WithEjection", "backoff %v..%v: the first must be positive and the cap at least as long", e.ejectBackoff, e.maxEjectBackoff)
	}
	if e.probeInterval < 0 {
		c.fail("WithHealthCheck", "interval %v is negative; use 0 to disable probes", e.probeInterval)
	}
	if c.lease <= ExpiryGuard {
		c.fail("WithPrefillLease", "%v must be longer than %v", c.lease, ExpiryGuard)
	}
	if c.decodeAttempts < 1 {
		c.fail("WithDecodeAttempts", "%d is less than 1", c.decodeAttempts)
	}
}

// WithPrefillEndpoints adds prefill endpoints with a data-parallel rank
// (sent as X-Data-Parallel-Rank) or a weight; see transport.Endpoint. It
// combines with WithPrefill. A zero weight means 1.
func WithPrefillEndpoints(eps ...transport.Endpoint) Option {
	return optionFunc(func(c *config) { c.ends.prefill = append(c.ends.prefill, eps...) })
}

// WithDecodeEndpoints adds decode endpoints, as WithPrefillEndpoints does.
func WithDecodeEndpoints(eps ...transport.Endpoint) Option {
	return optionFunc(func(c *config) { c.ends.decode = append(c.ends.decode, eps...) })
}

// WithEjection sets passive health checking: after failures consecutive
// failed requests (connection errors, timeouts, 5xx answers, broken
// streams) an endpoint is ejected from selection for an exponential
// backoff that starts at first and doubles up to limit, with jitter. When
// the time is up it is tried again; a success re-admits it and resets the
// backoff, a failure ejects it for the next interval. When every endpoint
// of a phase is ejected, selection falls back to all of them. The default
// is DefaultEjectAfter (3) failures, DefaultEjectBackoff (1 s) up to
// DefaultMaxEjectBackoff (30 s). failures 0 disables ejection; negative is
// an error.
func WithEjection(failures int, first, limit time.Duration) Option {
	return optionFunc(func(c *config) {
		c.ends.ejectAfter, c.ends.ejectBackoff, c.ends.maxEjectBackoff = failures, first, limit
	})
}

// WithHealthCheck turns on active health checking: every interval, each
// endpoint gets GET /health (with its rank header), bounded by timeout (0:
// the interval). A 200 re-admits an ejected endpoint at once; any other
// answer counts as a failure for WithEjection. The probes run on one
// goroutine that Close stops. The default is no probes (interval 0);
// negative is an error.
func WithHealthCheck(interval, timeout time.Duration) Option {
	return optionFunc(func(c *config) { c.ends.probeInterval, c.ends.probeTimeout = interval, timeout })
}

// WithPrefillLease tells the router the prefill engines'
// kv_lease_duration (default DefaultPrefillLease, vLLM's 30 s). A decode leg
// is sent with P's handle only while at least ExpiryGuard of the lease is
// left; later, the turn is redone as a plain miss. It must be longer than
// ExpiryGuard.
func WithPrefillLease(d time.Duration) Option {
	return optionFunc(func(c *config) { c.lease = d })
}

// WithDecodeAttempts bounds how many decode legs one turn may start,
// retries included (default DefaultDecodeAttempts, 3; 1 disables decode
// retries). After a leg that timed out, at most one more leg follows, to
// another healthy engine. See the package documentation for when a decode
// leg is retried.
func WithDecodeAttempts(n int) Option {
	return optionFunc(func(c *config) { c.decodeAttempts = n })
}

// healthPolicy is the router-wide part of health tracking.
type healthPolicy struct {
	cfg      endpointConfig
	clock    func() time.Time
	observer EndpointObserver
}

func (hp *healthPolicy) now() time.Time { return hp.clock() }

func (hp *healthPolicy) notify(ev EndpointEvent) {
	if hp.observer != nil {
		hp.observer.ObserveEndpoint(ev)
	}
}

// failed records a failed request on e. On a decode engine it is also a
// gap in what the router knows of its process (restart.go).
func (hp *healthPolicy) failed(e *endpoint, err error) {
	if e.phase == PhaseDecode {
		e.life.markGap(hp.now())
	}
	if hp.cfg.ejectAfter <= 0 {
		return
	}
	if ev, ok := e.health.failure(hp, hp.now()); ok {
		ev.Phase, ev.Endpoint, ev.Err = e.phase, e.url, err
		hp.notify(ev)
	}
}

// succeeded records a successful request on e.
func (hp *healthPolicy) succeeded(e *endpoint) {
	if e.health.success() {
		hp.notify(EndpointEvent{Phase: e.phase, Endpoint: e.url, Kind: EndpointReadmitted})
	}
}

// health is one endpoint's passive health state.
type health struct {
	mu      sync.Mutex
	fails   int
	ejected bool
	until   time.Time
	bo      *backoff.ExponentialBackOff
}

// eligible reports whether selection may consider the endpoint.
func (h *health) eligible(now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return !h.ejected || !now.Before(h.until)
}

func (h *health) state() (int, time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.fails, h.until
}

// failure counts a failure and reports an ejection when it causes one:
// on reaching the threshold, or on failing again after an ejection ran out.
func (h *health) failure(hp *healthPolicy, now time.Time) (EndpointEvent, bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.fails++
	if h.fails < hp.cfg.ejectAfter || (h.ejected && now.Before(h.until)) {
		return EndpointEvent{}, false
	}
	if h.bo == nil {
		h.bo = backoff.NewExponentialBackOff(
			backoff.WithInitialInterval(hp.cfg.ejectBackoff),
			backoff.WithMaxInterval(hp.cfg.maxEjectBackoff),
			backoff.WithMaxElapsedTime(0),
			backoff.WithRandomizationFactor(0.2),
		)
	}
	h.ejected = true
	h.until = now.Add(h.bo.NextBackOff())
	return EndpointEvent{Kind: EndpointEjected, Failures: h.fails, Until: h.until}, true
}

// success resets the state and reports whether the endpoint was ejected.
func (h *health) success() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	was := h.ejected
	h.fails, h.ejected = 0, false
	if h.bo != nil {
		h.bo.Reset()
	}
	return was
}

// startProbes starts the active health checks, if configured, and returns
// the function that stops them and waits for the goroutine to end.
func startProbes(hp *healthPolicy, client *transport.Client, apiKey string, pools ...*pool) func() error {
	iv := hp.cfg.probeInterval
	if iv <= 0 {
		return nil
	}
	timeout := hp.cfg.probeTimeout
	if timeout <= 0 {
		timeout = iv
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(iv)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			var wg sync.WaitGroup
			for _, p := range pools {
				for _, e := range p.list() {
					wg.Go(func() { probe(ctx, hp, client, apiKey, e, timeout) })
				}
			}
			wg.Wait()
		}
	}()
	return func() error {
		cancel()
		<-done
		return nil
	}
}

// errProbe is the failure recorded for a /health answer other than 200.
var errProbe = errors.New("kvroute: health probe failed")

// probe sends one GET /health to e and records the outcome.
func probe(ctx context.Context, hp *healthPolicy, client *transport.Client, apiKey string, e *endpoint, timeout time.Duration) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	req, err := e.ep.NewRequest(ctx, http.MethodGet, "/health", nil)
	if err != nil {
		return
	}
	if apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+apiKey)
	}
	resp, err := client.Do(req, transport.Deadlines{})
	if err == nil {
		_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			err = errProbe
		}
	}
	if ctx.Err() != nil && errors.Is(context.Cause(ctx), context.Canceled) {
		return // the router is closing
	}
	if err != nil {
		hp.failed(e, err)
		return
	}
	hp.succeeded(e)
}
