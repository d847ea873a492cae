package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/transport"
	"github.com/bidikv/bidikv/transport/discovery"
)

// dnsConfig is the command line of DNS discovery (--prefill-dns,
// --decode-dns): engine pools found in DNS, such as the headless Services
// of a Kubernetes deployment of vLLM, instead of fixed addresses.
type dnsConfig struct {
	prefill, decode     string
	prefillDP, decodeDP int
	refresh             time.Duration

	// Set by resolveDNS: the first answer of each DNS pool.
	initial map[string][]transport.Endpoint
}

// flags adds the DNS flags to fs.
func (d *dnsConfig) flags(fs *flag.FlagSet) {
	const names = "host:port (A/AAAA records of a headless Service, at that port) or _port._tcp.name (SRV records, which carry the ports); http:// or https:// may precede it"
	fs.StringVar(&d.prefill, "prefill-dns", "", "find the prefill engines in DNS, re-resolved every --dns-refresh: "+names+". Replaces --prefill/--prefiller-hosts")
	fs.StringVar(&d.decode, "decode-dns", "", "find the decode engines in DNS, as --prefill-dns. Replaces --decode/--decoder-hosts")
	fs.DurationVar(&d.refresh, "dns-refresh", discovery.DefaultInterval, "how often --prefill-dns and --decode-dns are resolved again")
	fs.IntVar(&d.prefillDP, "prefill-dp-size", 1, "data-parallel ranks behind each prefill address found in DNS (vLLM --data-parallel-size with its internal load balancer); requests are pinned with X-data-parallel-rank")
	fs.IntVar(&d.decodeDP, "decode-dp-size", 1, "data-parallel ranks behind each decode address found in DNS, as --prefill-dp-size")
}

// check validates the DNS flags; static tells whether fixed addresses were
// given for the prefill and decode pools.
func (d *dnsConfig) check(staticPrefill, staticDecode bool) error {
	switch {
	case d.prefill != "" && staticPrefill:
		return fmt.Errorf("%w: use either --prefill-dns or --prefill/--prefiller-hosts/--prefiller-ports, not both", errUsage)
	case d.decode != "" && staticDecode:
		return fmt.Errorf("%w: use either --decode-dns or --decode/--decoder-hosts/--decoder-ports, not both", errUsage)
	case d.prefillDP < 1 || d.decodeDP < 1:
		return fmt.Errorf("%w: --prefill-dp-size and --decode-dp-size must be at least 1", errUsage)
	case d.prefillDP > 1 && d.prefill == "" || d.decodeDP > 1 && d.decode == "":
		return fmt.Errorf("%w: --prefill-dp-size and --decode-dp-size apply to pools found in DNS: give --prefill-dns or --decode-dns", errUsage)
	}
	for _, p := range d.pools() {
		if _, err := p.source(nil); err != nil {
			return fmt.Errorf("%w: --%s-dns: %v", errUsage, p.role, err)
		}
	}
	return nil
}

// dnsPool is one pool found in DNS.
type dnsPool struct {
	role  string
	phase kvroute.Phase
	name  string
	dp    int
}

func (p dnsPool) source(r discovery.Resolver) (*discovery.DNS, error) {
	opts := []discovery.Option{discovery.WithDPSize(p.dp)}
	if r != nil {
		opts = append(opts, discovery.WithResolver(r))
	}
	return discovery.NewDNS(p.name, opts...)
}

func (d *dnsConfig) pools() []dnsPool {
	var out []dnsPool
	if d.prefill != "" {
		out = append(out, dnsPool{rolePrefill, kvroute.PhasePrefill, d.prefill, d.prefillDP})
	}
	if d.decode != "" {
		out = append(out, dnsPool{roleDecode, kvroute.PhaseDecode, d.decode, d.decodeDP})
	}
	return out
}

// poolOption is the router option of one pool: its first DNS answer, or
// its fixed URLs.
func (c *config) poolOption(role string) kvroute.Option {
	if eps, ok := c.dns.initial[role]; ok {
		if role == rolePrefill {
			return kvroute.WithEndpoints(kvroute.PhasePrefill, eps...)
		}
		return kvroute.WithEndpoints(kvroute.PhaseDecode, eps...)
	}
	if role == rolePrefill {
		return kvroute.WithPrefill(c.prefillURLs...)
	}
	return kvroute.WithDecode(c.decodeURLs...)
}

// baseURLs returns the distinct base URLs of eps (one per address, however
// many ranks it serves), for health probes and logs.
func baseURLs(eps []transport.Endpoint) []string {
	var out []string
	for _, ep := range eps {
		if u := ep.URL.String(); !slices.Contains(out, u) {
			out = append(out, u)
		}
	}
	return out
}

// resolveDNS resolves each DNS pool until it has engines, retrying every
// --dns-refresh, and sets the configuration's URLs from the answers. The
// proxy does not serve before: a router needs at least one engine of each
// phase. It returns early only when ctx ends.
func resolveDNS(ctx context.Context, c *config, r discovery.Resolver, log *slog.Logger) error {
	c.dns.initial = map[string][]transport.Endpoint{}
	for _, p := range c.dns.pools() {
		src, err := p.source(r)
		if err != nil {
			return fmt.Errorf("%w: --%s-dns: %v", errUsage, p.role, err)
		}
		logged := false
		for {
			rctx, cancel := context.WithTimeout(ctx, c.dns.refresh)
			eps, err := src.Resolve(rctx)
			cancel()
			if err == nil {
				c.dns.initial[p.role] = eps
				break
			}
			if !logged {
				log.Warn("waiting for engines in DNS", slog.String("role", p.role), slog.String("name", p.name), slog.String("err", err.Error()))
				logged = true
			}
			t := time.NewTimer(c.dns.refresh)
			select {
			case <-ctx.Done():
				t.Stop()
				return fmt.Errorf("proxy: --%s-dns %s: no engine found before shutdown: %w", p.role, p.name, err)
			case <-t.C:
			}
		}
		urls := baseURLs(c.dns.initial[p.role])
		if p.role == rolePrefill {
			c.prefillURLs = urls
		} else {
			c.decodeURLs = urls
		}
	}
	return nil
}

// watchDNS keeps the router's (through set: Router.SetEndpoints, or the
// sidecar's pools) and the health prober's engines in step with DNS until
// ctx ends or the returned function is called, which waits for the
// watchers to stop.
func watchDNS(parent context.Context, c *config, r discovery.Resolver, set func(kvroute.Phase, ...transport.Endpoint) error, h *health, m *metrics, log *slog.Logger) (func(), error) {
	ctx, cancel := context.WithCancel(parent)
	var wg sync.WaitGroup
	stop := func() { cancel(); wg.Wait() }
	for _, p := range c.dns.pools() {
		src, err := p.source(r)
		if err != nil {
			stop()
			return nil, err
		}
		apply := func(eps []transport.Endpoint) error {
			if err := set(p.phase, eps...); err != nil {
				return err
			}
			for _, e := range h.setEngines(p.role, baseURLs(eps)) {
				m.endpointUp.DeleteLabelValues(e.role, e.url)
			}
			return nil
		}
		w, err := discovery.NewWatcher(src, apply, discovery.WithInterval(c.dns.refresh), discovery.WithName(p.role),
			discovery.WithLogger(log.With(slog.String("component", "discovery"))))
		if err != nil {
			stop()
			return nil, err
		}
		m.watchDiscovery(p.role, w)
		wg.Go(func() {
			_ = w.Refresh(ctx) // the same set as the first answer, unless it changed since: counters start
			w.Run(ctx)
		})
	}
	return stop, nil
}

// watchDiscovery exports a pool's discovery counters.
func (m *metrics) watchDiscovery(role string, w *discovery.Watcher) {
	labels := prometheus.Labels{"role": role}
	counter := func(name, help string, get func(discovery.WatchStats) int64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help, ConstLabels: labels},
			func() float64 { return float64(get(w.Stats())) })
	}
	m.reg.MustRegister(
		counter("dns_refreshes_total", "DNS resolutions of the engine pool.", func(s discovery.WatchStats) int64 { return s.Refreshes }),
		counter("dns_changes_total", "Changed engine sets applied from DNS.", func(s discovery.WatchStats) int64 { return s.Changes }),
		counter("dns_failures_total", "DNS resolutions that failed (the last good engines stayed).", func(s discovery.WatchStats) int64 { return s.Failures }),
		counter("dns_empty_total", "DNS answers with no records (the pool was emptied: turns get 503).", func(s discovery.WatchStats) int64 { return s.Empty }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: "dns_endpoints", ConstLabels: labels,
			Help: "Endpoints (addresses times data-parallel ranks) of the pool from the last DNS answer applied."},
			func() float64 { return float64(w.Stats().Endpoints) }),
	)
}
