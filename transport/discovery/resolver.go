package discovery

import (
	"context"
	"net"
)

// Resolver looks up names; *net.Resolver implements it, and tests may
// substitute a stand-in. Errors should be *net.DNSError, whose IsNotFound
// tells an authoritative "no such records" from a failure to resolve, as
// the standard library's are.
type Resolver interface {
	// LookupHost returns the addresses of host (A and AAAA records).
	LookupHost(ctx context.Context, host string) ([]string, error)
	// LookupSRV returns SRV records; with service and proto empty, as this
	// package calls it, it looks name up directly.
	LookupSRV(ctx context.Context, service, proto, name string) (string, []*net.SRV, error)
}

var _ Resolver = (*net.Resolver)(nil)
