package discovery

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"

	"github.com/bidikv/bidikv/transport"
)

// Errors of this package.
var (
	// ErrInvalidConfig wraps every error of NewDNS and NewWatcher: a
	// malformed name or an option out of range.
	ErrInvalidConfig = errors.New("discovery: invalid configuration")
	// ErrNoRecords means the name resolved to no address: NXDOMAIN, no
	// record of the type asked, or only SRV records with target ".". A
	// headless Service with no ready pod answers so.
	ErrNoRecords = errors.New("discovery: no records")
)

// Source gives the current endpoints of one pool.
type Source interface {
	// Resolve returns the endpoints, an error wrapping ErrNoRecords when
	// there are none, or another error when they could not be found.
	Resolve(ctx context.Context) ([]transport.Endpoint, error)
}

// DNS is a Source that resolves one name. It is safe for concurrent use.
type DNS struct {
	name   string // as given, for logs
	scheme string // http or https
	host   string // the name to look up: A/AAAA host, or the SRV name
	port   int    // 0 for SRV
	srv    bool
	res    Resolver
	dpSize int
}

var _ Source = (*DNS)(nil)

// Option configures a DNS source.
type Option interface{ apply(*DNS) }

type optionFunc func(*DNS)

func (f optionFunc) apply(d *DNS) { f(d) }

// WithResolver sets the resolver; the default is net.DefaultResolver (the
// system's, or Go's own when built with CGO_ENABLED=0, which caches
// nothing, so each refresh asks the DNS server).
func WithResolver(r Resolver) Option { return optionFunc(func(d *DNS) { d.res = r }) }

// WithDPSize declares that each address serves n data-parallel ranks behind
// one HTTP server (vLLM's --data-parallel-size n with its internal load
// balancer): each address then gives n endpoints pinned to the ranks 0..n-1
// (transport.RankHeader), so that the router balances ranks and keeps a
// conversation on the rank that holds its KV. The default, 1, gives one
// endpoint per address without a rank, which is also right when every rank
// is its own server and address (vLLM's external load balancing). vLLM's
// HTTP API does not report the data-parallel size outside its development
// mode, so it is given here, per pool. n below 1 is an error.
func WithDPSize(n int) Option { return optionFunc(func(d *DNS) { d.dpSize = n }) }

// NewDNS returns a source for name, optionally prefixed with "http://"
// (the default) or "https://":
//
//   - "host:port": the A and AAAA records of host, each address at port,
//     e.g. "vllm-decode.llm.svc.cluster.local:8000" for a headless Service.
//   - "_service._proto.name": the SRV records of that name, e.g.
//     "_http._tcp.vllm-decode.llm.svc.cluster.local" for a headless
//     Service's port named http. Each record's target is resolved to its
//     addresses, at the record's port. Only the records of the lowest
//     priority are used; their weights become endpoint weights when they
//     differ (a weight of 0 counts as 1).
//
// A name with a path, query, user info, or a port out of range is an error
// wrapping ErrInvalidConfig. NewDNS does no network I/O.
func NewDNS(name string, opts ...Option) (*DNS, error) {
	d := &DNS{name: strings.TrimSpace(name), scheme: "http", res: net.DefaultResolver, dpSize: 1}
	for _, o := range opts {
		o.apply(d)
	}
	fail := func(format string, args ...any) (*DNS, error) {
		return nil, fmt.Errorf("%w: DNS name %q: %s", ErrInvalidConfig, d.name, fmt.Sprintf(format, args...))
	}
	if d.res == nil {
		return fail("WithResolver(nil)")
	}
	if d.dpSize < 1 {
		return fail("WithDPSize(%d): the data-parallel size must be at least 1", d.dpSize)
	}
	rest := d.name
	if i := strings.Index(rest, "://"); i >= 0 {
		d.scheme, rest = rest[:i], rest[i+3:]
		if d.scheme != "http" && d.scheme != "https" {
			return fail("scheme must be http or https")
		}
	}
	if rest == "" {
		return fail("empty name")
	}
	if strings.ContainsAny(rest, "/?#@ ") {
		return fail("a name is host:port or _service._proto.name, without path, query or user info")
	}
	if strings.HasPrefix(rest, "_") {
		if strings.Contains(rest, ":") {
			return fail("an SRV name carries its ports; remove the port")
		}
		if strings.Count(strings.TrimSuffix(rest, "."), ".") < 2 {
			return fail("an SRV name is _service._proto.name")
		}
		d.host, d.srv = rest, true
		return d, nil
	}
	host, port, err := net.SplitHostPort(rest)
	if err != nil {
		return fail("want host:port (a headless Service's A/AAAA records carry no port) or an SRV name _service._proto.name")
	}
	p, err := strconv.Atoi(port)
	if err != nil || p < 1 || p > 65535 {
		return fail("port must be between 1 and 65535")
	}
	if host == "" {
		return fail("missing host")
	}
	d.host, d.port = host, p
	return d, nil
}

// String returns the name as given.
func (d *DNS) String() string { return d.name }

// addr is one resolved address.
type addr struct {
	ip     string
	port   int
	weight int
}

// Resolve looks the name up and returns its endpoints, sorted by address,
// port and rank. A name that does not exist or has no usable record is an
// error wrapping ErrNoRecords; any other failure of the resolver is
// returned as it is.
func (d *DNS) Resolve(ctx context.Context) ([]transport.Endpoint, error) {
	var addrs []addr
	if d.srv {
		var err error
		if addrs, err = d.lookupSRV(ctx); err != nil {
			return nil, err
		}
	} else {
		ips, err := d.res.LookupHost(ctx, d.host)
		if err != nil {
			return nil, d.lookupErr(err)
		}
		for _, ip := range ips {
			addrs = append(addrs, addr{ip: ip, port: d.port, weight: 1})
		}
	}
	if len(addrs) == 0 {
		return nil, fmt.Errorf("%w for %s", ErrNoRecords, d.name)
	}
	eps := make([]transport.Endpoint, 0, len(addrs)*d.dpSize)
	seen := make(map[string]bool, len(addrs))
	for _, a := range addrs {
		hp := net.JoinHostPort(a.ip, strconv.Itoa(a.port))
		if seen[hp] {
			continue
		}
		seen[hp] = true
		ep, err := transport.ParseEndpoint(d.scheme + "://" + hp)
		if err != nil {
			return nil, fmt.Errorf("discovery: %s: %w", d.name, err)
		}
		ep.Weight = a.weight
		if d.dpSize == 1 {
			eps = append(eps, ep)
			continue
		}
		for k := range d.dpSize {
			ep.Rank = k
			eps = append(eps, ep)
		}
	}
	slices.SortFunc(eps, func(a, b transport.Endpoint) int {
		return cmp.Or(strings.Compare(a.URL.Host, b.URL.Host), cmp.Compare(a.Rank, b.Rank))
	})
	return eps, nil
}

// lookupSRV returns the addresses of the lowest-priority SRV records.
func (d *DNS) lookupSRV(ctx context.Context) ([]addr, error) {
	_, recs, err := d.res.LookupSRV(ctx, "", "", d.host)
	if err != nil {
		return nil, d.lookupErr(err)
	}
	recs = slices.DeleteFunc(slices.Clone(recs), func(r *net.SRV) bool { return r == nil || r.Target == "." || r.Target == "" })
	if len(recs) == 0 {
		return nil, nil
	}
	low := slices.MinFunc(recs, func(a, b *net.SRV) int { return cmp.Compare(a.Priority, b.Priority) }).Priority
	recs = slices.DeleteFunc(recs, func(r *net.SRV) bool { return r.Priority != low })
	equal := !slices.ContainsFunc(recs, func(r *net.SRV) bool { return r.Weight != recs[0].Weight })
	var out []addr
	for _, r := range recs {
		ips, err := d.res.LookupHost(ctx, strings.TrimSuffix(r.Target, "."))
		if err != nil {
			if notFound(err) {
				continue // the target went away between the two answers
			}
			return nil, d.lookupErr(err)
		}
		w := 1
		if !equal {
			w = max(1, int(r.Weight))
		}
		for _, ip := range ips {
			out = append(out, addr{ip: ip, port: int(r.Port), weight: w})
		}
	}
	return out, nil
}

func (d *DNS) lookupErr(err error) error {
	if notFound(err) {
		return fmt.Errorf("%w for %s: %v", ErrNoRecords, d.name, err)
	}
	return fmt.Errorf("discovery: resolving %s: %w", d.name, err)
}

// notFound reports an authoritative answer that the records do not exist.
func notFound(err error) bool {
	var de *net.DNSError
	return errors.As(err, &de) && de.IsNotFound
}
