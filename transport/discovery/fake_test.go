package discovery_test

import (
	"context"
	"net"
	"strings"
	"sync"
)

// fakeDNS is a stand-in for a DNS server: A/AAAA answers by host and SRV
// answers by name, with an injected failure. Names are looked up without a
// trailing dot.
type fakeDNS struct {
	mu    sync.Mutex
	hosts map[string][]string
	srv   map[string][]*net.SRV
	fail  error // returned by every lookup while set
	calls int
}

func newFakeDNS() *fakeDNS {
	return &fakeDNS{hosts: map[string][]string{}, srv: map[string][]*net.SRV{}}
}

func (f *fakeDNS) setHost(name string, ips ...string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if ips == nil {
		delete(f.hosts, name)
		return
	}
	f.hosts[name] = ips
}

func (f *fakeDNS) setSRV(name string, recs ...*net.SRV) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if recs == nil {
		delete(f.srv, name)
		return
	}
	f.srv[name] = recs
}

func (f *fakeDNS) setFail(err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.fail = err
}

func (f *fakeDNS) LookupHost(_ context.Context, host string) ([]string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.fail != nil {
		return nil, f.fail
	}
	ips, ok := f.hosts[strings.TrimSuffix(host, ".")]
	if !ok {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	return append([]string(nil), ips...), nil
}

func (f *fakeDNS) LookupSRV(_ context.Context, service, proto, name string) (string, []*net.SRV, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if service != "" || proto != "" {
		panic("discovery looks SRV names up whole")
	}
	if f.fail != nil {
		return "", nil, f.fail
	}
	recs, ok := f.srv[strings.TrimSuffix(name, ".")]
	if !ok {
		return "", nil, &net.DNSError{Err: "no such host", Name: name, IsNotFound: true}
	}
	out := make([]*net.SRV, len(recs))
	for i, r := range recs {
		c := *r
		out[i] = &c
	}
	return name, out, nil
}

// errServFail is a temporary failure, as a DNS server that answers
// SERVFAIL gives.
var errServFail = &net.DNSError{Err: "server misbehaving", Name: "x", IsTemporary: true}
