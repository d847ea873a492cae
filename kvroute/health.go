package kvroute

import (
	"context"
	"errors"
	"net/http"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/transport"
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
	// Learned is what real turns showed of the engine's capabilities,
	// under kvroute/capability's names (capability.Report.Learn takes
	// them): stream handles per API and bidirectional transfer of a decode
	// engine, render routes, /tokenize and per-API handles of a prefill
	// engine; what turns have not shown is left out. A restart the router
	// notices drops what was learned of a decode engine.
	Learned []capability.Named
	// BlockSize is the KV block size the router uses for the engine's
	// handles (their block-count check, partial reads, fingerprints):
	// the one the engine's /metrics reports (BlockSizeSource "engine"),
	// else WithVerification's BlockSize ("configured"); 0 while unknown
	// (not read yet, or reported nowhere), and then its handles' block
	// counts are not checked nor read in part.
	BlockSize       int
	BlockSizeSource string
	// KVGroups is the number of KV-cache groups in the engine's last
	// handle that fitted its block size (one for a dense or MLA model,
	// more for hybrid ones); 0 until then.
	KVGroups int
	// NoReuse says why the engine serves without reuse now ("" when it
	// does not): a handle of it did not fit its block size (Stats.
	// UnvalidatedHandles), so its turns run as plain requests on the
	// decode engine until it reports another size or a minute passes.
	NoReuse string
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
func startProbes(hp *healthPolicy, client *upstream.Client, pools ...*pool) func() error {
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
					wg.Go(func() { probe(ctx, hp, client, e, timeout) })
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
func probe(ctx context.Context, hp *healthPolicy, client *upstream.Client, e *endpoint, timeout time.Duration) {
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	status, err := client.Call(ctx, e.ep, upstream.Call{Path: "/health", Limit: 4096}, nil)
	if status != 0 && status != http.StatusOK {
		err = errProbe
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
