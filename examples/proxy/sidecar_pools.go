package main

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/transport"
)

// legs are the engines one turn goes to in the sidecar: the prefill engine
// x-prefiller-host-port named and the local decode engine of the listener
// the request came in on. It rides in the turn's context, where the
// sidecar's Selector (pinned) and the transport's tap (cachedTap) read it.
type legs struct {
	prefill, decode string // engine URLs, as the router names them
	prefillHost     string // prefill's host:port, as its requests' URLs carry it
	// cached is usage.prompt_tokens_details.cached_tokens of the last
	// prefill answer of the turn (0 when it reported none, as llm-d
	// counts it; -1 before any answer).
	cached atomic.Int64
}

type routeKey struct{}

func withRoute(ctx context.Context, rt *legs) context.Context {
	return context.WithValue(ctx, routeKey{}, rt)
}

func routeOf(ctx context.Context) *legs {
	rt, _ := ctx.Value(routeKey{}).(*legs)
	return rt
}

// pinned is the sidecar's kvroute.Selector: each leg goes to the engine
// its turn's legs name, the prefill engine of the header and the local
// decode engine, never to another. When that engine is not among the
// candidates (it failed this turn and is excluded), it says so with
// kvroute.ErrNoEndpoint, and the router tries the excluded engines again:
// so a prefill retry goes to the same engine, as llm-d's. A pick without a
// route (the background release of a decode hold, which needs a prefill
// engine) is LeastLoaded's, over the prefill pool and the engines the
// header named lately.
type pinned struct{ other kvroute.LeastLoaded }

var _ kvroute.Selector = (*pinned)(nil)

// Select implements kvroute.Selector.
func (p *pinned) Select(ctx context.Context, s *kvroute.Selection) (int, error) {
	rt := routeOf(ctx)
	if rt == nil {
		return p.other.Select(ctx, s)
	}
	want := rt.decode
	if s.Phase == kvroute.PhasePrefill {
		want = rt.prefill
	}
	if i := slices.IndexFunc(s.Candidates, func(c kvroute.Candidate) bool { return c.URL == want }); i >= 0 {
		return i, nil
	}
	return 0, fmt.Errorf("%w: the turn's %s engine %s failed this turn", kvroute.ErrNoEndpoint, s.Phase, want)
}

// Bounds of the prefill engines learned from the header.
const (
	maxLearned  = 256              // at most this many, the least recently named go first
	learnedIdle = 10 * time.Minute // one not named for this long goes
)

// pools keeps the router's engines: decode, the local engine's ranks and
// the other decode pods (--decode, --decode-dns); prefill, the prefill pool
// (--prefill, --prefill-dns) and every engine the header named lately,
// which the router must list to route a leg to it and which background
// releases of decode holds may use. It is also the SSRF allowlist's view of
// the pools.
type pools struct {
	now    func() time.Time
	scheme string // of the header's engines: http:// or https:// (--enable-tls prefiller)

	mu       sync.Mutex
	router   *kvroute.Router
	health   *health
	local    []transport.Endpoint
	dnsP     []transport.Endpoint // the prefill pool's last answer (or fixed URLs)
	dnsD     []transport.Endpoint // the other decode pods'
	learned  map[string]*learnedP
	decodeOf atomic.Pointer[map[string]bool] // hosts (host:port) of decode engines
	hosts    atomic.Pointer[map[string]bool] // hosts (no port) of both pools, for the allowlist
}

// learnedP is a prefill engine the header named.
type learnedP struct {
	ep   transport.Endpoint
	used time.Time
}

func newPools(now func() time.Time, prefillTLS bool, local, prefill, decode []string) (*pools, error) {
	p := &pools{now: now, scheme: "http://", learned: map[string]*learnedP{}}
	if prefillTLS {
		p.scheme = "https://"
	}
	var err error
	if p.local, err = parseEndpoints(local); err != nil {
		return nil, err
	}
	if p.dnsP, err = parseEndpoints(prefill); err != nil {
		return nil, err
	}
	if p.dnsD, err = parseEndpoints(decode); err != nil {
		return nil, err
	}
	p.index()
	return p, nil
}

func parseEndpoints(urls []string) ([]transport.Endpoint, error) {
	out := make([]transport.Endpoint, 0, len(urls))
	for _, u := range urls {
		ep, err := transport.ParseEndpoint(u)
		if err != nil {
			return nil, err
		}
		out = append(out, ep)
	}
	return out, nil
}

// attach gives the pools the router and health checks they keep in step,
// and applies the current sets (the router was built with a stand-in
// prefill engine when no pool was given: kvroute.New needs one).
func (p *pools) attach(r *kvroute.Router, h *health) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.router, p.health = r, h
	if err := p.applyLocked(kvroute.PhaseDecode); err != nil {
		return err
	}
	return p.applyLocked(kvroute.PhasePrefill)
}

// set is watchDNS's: a pool's new answer.
func (p *pools) set(phase kvroute.Phase, eps ...transport.Endpoint) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if phase == kvroute.PhasePrefill {
		p.dnsP = slices.Clone(eps)
	} else {
		p.dnsD = slices.Clone(eps)
	}
	return p.applyLocked(phase)
}

// learn makes sure the prefill engine at hostPort (the header's value) is
// listed, and returns its URL as the router names it.
func (p *pools) learn(hostPort string) (string, error) {
	ep, err := transport.ParseEndpoint(p.scheme + hostPort)
	if err != nil {
		return "", err
	}
	key := ep.String()
	p.mu.Lock()
	defer p.mu.Unlock()
	if slices.ContainsFunc(p.dnsP, func(e transport.Endpoint) bool { return e.String() == key }) {
		return key, nil
	}
	now := p.now()
	if l, ok := p.learned[key]; ok {
		l.used = now
		return key, nil
	}
	p.learned[key] = &learnedP{ep: ep, used: now}
	p.expireLocked(now)
	return key, p.applyLocked(kvroute.PhasePrefill)
}

// expireLocked drops learned engines idle for learnedIdle, and the least
// recently named beyond maxLearned.
func (p *pools) expireLocked(now time.Time) {
	for k, l := range p.learned {
		if now.Sub(l.used) >= learnedIdle {
			delete(p.learned, k)
		}
	}
	for len(p.learned) > maxLearned {
		oldest := ""
		for k, l := range p.learned {
			if oldest == "" || l.used.Before(p.learned[oldest].used) {
				oldest = k
			}
		}
		delete(p.learned, oldest)
	}
}

// applyLocked sets the router's and the health checks' engines of phase.
func (p *pools) applyLocked(phase kvroute.Phase) error {
	var eps []transport.Endpoint
	role := rolePrefill
	if phase == kvroute.PhasePrefill {
		eps = slices.Clone(p.dnsP)
		keys := make([]string, 0, len(p.learned))
		for k := range p.learned {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		for _, k := range keys {
			eps = appendNew(eps, p.learned[k].ep)
		}
	} else {
		role = roleDecode
		eps = slices.Clone(p.local)
		for _, e := range p.dnsD {
			eps = appendNew(eps, e)
		}
	}
	p.index()
	if p.router == nil {
		return nil
	}
	if err := p.router.SetEndpoints(phase, eps...); err != nil {
		return err
	}
	p.health.setEngines(role, baseURLs(eps))
	return nil
}

// appendNew appends e unless eps has an endpoint of its URL and rank.
func appendNew(eps []transport.Endpoint, e transport.Endpoint) []transport.Endpoint {
	if slices.ContainsFunc(eps, func(x transport.Endpoint) bool { return x.String() == e.String() }) {
		return eps
	}
	return append(eps, e)
}

// index rebuilds the host sets the transport and the allowlist read.
func (p *pools) index() {
	dec, hosts := map[string]bool{}, map[string]bool{}
	for _, e := range slices.Concat(p.local, p.dnsD) {
		dec[e.URL.Host] = true
		hosts[e.URL.Hostname()] = true
	}
	for _, e := range p.dnsP {
		hosts[e.URL.Hostname()] = true
	}
	p.decodeOf.Store(&dec)
	p.hosts.Store(&hosts)
}

// isDecode reports whether host (host:port) is a decode engine's.
func (p *pools) isDecode(host string) bool { return (*p.decodeOf.Load())[host] }

// allowlist is --enable-ssrf-protection's: the pools' hosts and
// --ssrf-allowlist's hosts and ranges. Like llm-d's, it checks the host and
// not the port.
type allowlist struct {
	on     bool
	pools  *pools
	names  map[string]bool
	ranges []netip.Prefix
}

func newAllowlist(on bool, p *pools, entries []string) *allowlist {
	a := &allowlist{on: on, pools: p, names: map[string]bool{}}
	for _, e := range entries {
		if pfx, err := netip.ParsePrefix(e); err == nil {
			a.ranges = append(a.ranges, pfx.Masked())
			continue
		}
		a.names[strings.ToLower(strings.Trim(e, "[]"))] = true
	}
	return a
}

// allowed reports whether the header's hostPort may be reached.
func (a *allowlist) allowed(hostPort string) bool {
	if !a.on {
		return true
	}
	host := hostPort
	if h, _, err := net.SplitHostPort(hostPort); err == nil {
		host = h
	}
	host = strings.ToLower(strings.Trim(host, "[]"))
	if a.names[host] || (*a.pools.hosts.Load())[host] {
		return true
	}
	if ip, err := netip.ParseAddr(host); err == nil {
		ip = ip.Unmap()
		for _, r := range a.ranges {
			if r.Contains(ip) {
				return true
			}
		}
		// The pools name engines by address: compare addresses, not
		// spellings (an IPv6 address has several).
		for h := range *a.pools.hosts.Load() {
			if o, err := netip.ParseAddr(h); err == nil && o.Unmap() == ip {
				return true
			}
		}
	}
	return false
}
