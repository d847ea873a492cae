package kvroute

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"net/http"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/internal/decodemem"
	"github.com/bidikv/bidikv/kvroute/internal/enginepool"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/transport"
)

// endpoint is an upstream engine (or one data-parallel rank of one) with
// its live load and health. A turn keeps the *endpoint it picked until it
// ends, even if SetEndpoints removes it meanwhile.
type endpoint struct {
	ep       transport.Endpoint
	url      string
	phase    Phase
	inflight atomic.Int64
	health   enginepool.Health  // passive health: ejection and re-admission
	life     enginepool.Life    // a decode engine's process (pressure.go)
	mem      decodemem.Pressure // a decode engine's memory pressure (pressure.go)
	kv       enginepool.Shape   // its block size and KV groups (shape.go)
	// urls caches the request URL of each path (pathURL): a map that is
	// replaced, never modified, when a path is added.
	urls atomic.Pointer[map[string]*url.URL]
}

// pathURL returns transport.Endpoint.PathURL(path) from a cache; the
// caller must not modify it. Paths are the router's own few API and render
// routes, so the cache stays small.
func (e *endpoint) pathURL(path string) (*url.URL, error) {
	m := e.urls.Load()
	if m != nil {
		if u, ok := (*m)[path]; ok {
			return u, nil
		}
	}
	u, err := e.ep.PathURL(path)
	if err != nil {
		return nil, err
	}
	for {
		next := make(map[string]*url.URL, 4)
		if m != nil {
			maps.Copy(next, *m)
		}
		next[path] = u
		if e.urls.CompareAndSwap(m, &next) {
			return u, nil
		}
		m = e.urls.Load()
	}
}

// pool is the set of endpoints of one phase. Readers load the slice
// without locking; SetEndpoints swaps it.
type pool struct {
	phase Phase
	hp    *healthPolicy
	// press fills a decode candidate's pressure (decodeMemory.press); nil
	// for prefill, and when decode memory management is off.
	press func(e *endpoint, c *Candidate)
	mu    sync.Mutex // serialises set
	eps   atomic.Pointer[[]*endpoint]
}

func newPool(phase Phase, hp *healthPolicy, addrs []string, eps []transport.Endpoint) (*pool, error) {
	all := make([]transport.Endpoint, 0, len(addrs)+len(eps))
	for _, a := range addrs {
		ep, err := transport.ParseEndpoint(a)
		if err != nil {
			return nil, err
		}
		all = append(all, ep)
	}
	all = append(all, eps...)
	if len(all) == 0 {
		return nil, fmt.Errorf("no %s endpoint; pass at least one", phase)
	}
	p := &pool{phase: phase, hp: hp}
	if _, err := p.set(all, false); err != nil {
		return nil, err
	}
	return p, nil
}

// list returns the current endpoints; the caller must not modify it.
func (p *pool) list() []*endpoint {
	if l := p.eps.Load(); l != nil {
		return *l
	}
	return nil
}

// set replaces the endpoints, keeping the load and health state of those
// that stay, and returns the events to report. An empty list empties the
// pool.
func (p *pool) set(eps []transport.Endpoint, report bool) ([]EndpointEvent, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	old := p.list()
	next := make([]*endpoint, 0, len(eps))
	var events []EndpointEvent
	for _, ep := range eps {
		if ep.URL == nil {
			return nil, fmt.Errorf("%w: endpoint without URL", transport.ErrInvalidEndpoint)
		}
		if ep.Weight < 0 {
			return nil, fmt.Errorf("%w: endpoint %s has negative weight %d", transport.ErrInvalidEndpoint, ep, ep.Weight)
		}
		if ep.Weight == 0 {
			ep.Weight = 1
		}
		key := ep.String()
		if slices.ContainsFunc(next, func(e *endpoint) bool { return e.url == key }) {
			return nil, fmt.Errorf("%w: endpoint %s listed twice", transport.ErrInvalidEndpoint, key)
		}
		if i := slices.IndexFunc(old, func(e *endpoint) bool { return e.url == key }); i >= 0 && old[i].ep.Weight == ep.Weight {
			next = append(next, old[i])
			continue
		}
		next = append(next, &endpoint{ep: ep, url: key, phase: p.phase})
		events = append(events, EndpointEvent{Phase: p.phase, Endpoint: key, Kind: EndpointAdded})
	}
	for _, e := range old {
		if !slices.ContainsFunc(next, func(n *endpoint) bool { return n == e }) {
			events = append(events, EndpointEvent{Phase: p.phase, Endpoint: e.url, Kind: EndpointRemoved})
		}
	}
	p.eps.Store(&next)
	if !report {
		events = nil
	}
	return events, nil
}

// pick runs the selector over the healthy endpoints not excluded (or, when
// none is healthy, over all those not excluded).
func (p *pool) pick(ctx context.Context, sel Selector, req *Request, affinity, hint string, exclude []string) (*endpoint, error) {
	all := p.list()
	now := p.hp.now()
	// The Selection and, for a few endpoints, its candidates in one
	// allocation; the endpoints beside them on the stack.
	ps := &pickSelection{}
	cands := ps.cands[:0]
	var epsBuf [len(ps.cands)]*endpoint
	eps := epsBuf[:0]
	for _, healthy := range [...]bool{true, false} {
		for _, e := range all {
			if slices.Contains(exclude, e.url) || (healthy && !e.health.Eligible(now)) {
				continue
			}
			cands = append(cands, Candidate{URL: e.url, InFlight: int(e.inflight.Load()), Weight: e.ep.Weight, Rank: e.ep.Rank, Healthy: healthy})
			if p.press != nil {
				p.press(e, &cands[len(cands)-1])
			}
			eps = append(eps, e)
		}
		if len(cands) > 0 {
			break
		}
	}
	if len(cands) == 0 {
		return nil, ErrNoEndpoint
	}
	if !slices.ContainsFunc(cands, func(c Candidate) bool { return c.URL == affinity }) {
		affinity = ""
	}
	ps.sel = Selection{Phase: p.phase, Request: req, Candidates: cands, Affinity: affinity, Hint: hint, Exclude: exclude}
	i, err := sel.Select(ctx, &ps.sel)
	if err != nil {
		return nil, err
	}
	if i < 0 || i >= len(eps) {
		return nil, fmt.Errorf("%w: the selector returned %d for %d candidates", ErrNoEndpoint, i, len(eps))
	}
	return eps[i], nil
}

// pickSelection is a Selection with room for the candidates of a small
// pool.
type pickSelection struct {
	sel   Selection
	cands [8]Candidate
}

// hasOther reports whether an endpoint outside exclude is eligible now
// (not ejected): one that a leg may be sent to with reason to expect an
// answer.
func (p *pool) hasOther(exclude []string) bool {
	now := p.hp.now()
	for _, e := range p.list() {
		if !slices.Contains(exclude, e.url) && e.health.Eligible(now) {
			return true
		}
	}
	return false
}

// eligible returns the current endpoint whose URL is url when it is not
// ejected, else nil.
func (p *pool) eligible(url string) *endpoint {
	if e := p.find(url); e != nil && e.health.Eligible(p.hp.now()) {
		return e
	}
	return nil
}

// find returns the current endpoint whose URL is url, or nil.
func (p *pool) find(url string) *endpoint {
	eps := p.list()
	if i := slices.IndexFunc(eps, func(e *endpoint) bool { return e.url == url }); i >= 0 {
		return eps[i]
	}
	return nil
}

// SetEndpoints replaces the endpoints of phase (PhasePrefill or
// PhaseDecode), for discovery by DNS (package transport/discovery), Kubernetes or a
// configuration file. Endpoints that stay (same URL and rank) keep their
// load and health; turns in flight finish on the endpoint they picked, even
// a removed one, but no new leg is sent to it. A retained handle whose
// decode endpoint is no longer listed is not attached (MissEndpointGone)
// and is left in the store to expire. Added and removed endpoints are
// reported to an EndpointObserver.
//
// No endpoints at all empties the phase, as a Service scaled to zero does:
// turns then fail with ErrNoEndpoint (503) until endpoints are set again.
// A duplicate, an endpoint without URL or with a negative weight is an
// error and changes nothing; a zero weight means 1.
func (r *Router) SetEndpoints(phase Phase, eps ...transport.Endpoint) error {
	p := r.pool(phase)
	if p == nil {
		return fmt.Errorf("%w: SetEndpoints: phase %q is neither %q nor %q", ErrInvalidConfig, phase, PhasePrefill, PhaseDecode)
	}
	events, err := p.set(eps, true)
	if err != nil {
		return fmt.Errorf("%w: SetEndpoints: %v", ErrInvalidConfig, err)
	}
	for _, ev := range events {
		r.hp.notify(ev)
	}
	if phase == PhaseDecode {
		forgetLeft(r.mem, r.cfg.clock())
	}
	return nil
}

// pool returns the endpoints of phase, nil for a phase without endpoints.
func (r *Router) pool(phase Phase) *pool {
	switch phase {
	case PhasePrefill:
		return r.prefill
	case PhaseDecode:
		return r.decode
	}
	return nil
}

// Endpoints returns the endpoints of phase with their state, in
// configuration order.
func (r *Router) Endpoints(phase Phase) []EndpointStatus {
	p := r.pool(phase)
	if p == nil {
		return nil
	}
	now := r.hp.now()
	var out []EndpointStatus
	for _, e := range p.list() {
		fails, until := e.health.State()
		out = append(out, EndpointStatus{
			Endpoint: e.ep, URL: e.url, InFlight: int(e.inflight.Load()),
			Healthy: e.health.Eligible(now), Failures: fails, EjectedUntil: until,
			Learned: r.learned.facts(e.url, r.renders.caps.missingOn(e.url)),
		})
		r.shapes.status(e, &out[len(out)-1])
		if phase == PhaseDecode && r.mem.cfg.on {
			out[len(out)-1].NoCapacity = e.mem.NoCapacity()
		}
	}
	return out
}

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
	// NoCapacity says why a decode engine's KV capacity is unknown ("" when
	// it is known, not read yet, or the management is off): its /metrics
	// answered without vllm:cache_config_info, or not with 200. Decode
	// memory management is then off for it (Stats.CapacityUnknown); the
	// fix is DecodeMemory's Capacity (bidikv-proxy: --decode-kv-capacity).
	NoCapacity string
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
// gap in what the router knows of its process (pressure.go).
func (hp *healthPolicy) failed(e *endpoint, err error) {
	if e.phase == PhaseDecode {
		e.life.MarkGap(hp.now())
	}
	if hp.cfg.ejectAfter <= 0 {
		return
	}
	ej := enginepool.Ejection{After: hp.cfg.ejectAfter, Backoff: hp.cfg.ejectBackoff, MaxDelay: hp.cfg.maxEjectBackoff}
	if fails, until, ok := e.health.Failure(ej, hp.now()); ok {
		hp.notify(EndpointEvent{Phase: e.phase, Endpoint: e.url, Kind: EndpointEjected, Failures: fails, Until: until, Err: err})
	}
}

// succeeded records a successful request on e.
func (hp *healthPolicy) succeeded(e *endpoint) {
	if e.health.Success() {
		hp.notify(EndpointEvent{Phase: e.phase, Endpoint: e.url, Kind: EndpointReadmitted})
	}
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
	return enginepool.StartProbes(iv, func(ctx context.Context) {
		var wg sync.WaitGroup
		for _, p := range pools {
			for _, e := range p.list() {
				wg.Go(func() { probe(ctx, hp, client, e, timeout) })
			}
		}
		wg.Wait()
	})
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
