package discovery_test

import (
	"context"
	"encoding/binary"
	"errors"
	"net"
	"net/netip"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport/discovery"
)

// DNS record types and response codes the server below speaks.
const (
	typeA    = 1
	typeAAAA = 28
	typeSRV  = 33

	rcodeServFail = 2
	rcodeNXDomain = 3
)

// zone is what the test DNS server answers: per name, records by type, or
// an error code. A name listed with no records of the type asked answers
// NOERROR with no records (NODATA); an unlisted name answers NXDOMAIN.
type zone struct {
	mu    sync.Mutex
	names map[string]*rrset
}

type rrset struct {
	rcode int
	addrs []netip.Addr
	srv   []*net.SRV
}

func (z *zone) set(name string, rs *rrset) {
	z.mu.Lock()
	defer z.mu.Unlock()
	if rs == nil {
		delete(z.names, name)
		return
	}
	z.names[name] = rs
}

// serveDNS runs a minimal authoritative DNS server for z on 127.0.0.1 UDP
// and returns a resolver that asks only it, through the standard library's
// own DNS client (PreferGo), so that the answers are classified exactly as
// in production.
func serveDNS(t *testing.T, z *zone) *net.Resolver {
	t.Helper()
	pc, err := net.ListenPacket("udp", "127.0.0.1:0")
	require.NoError(t, err)
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 1500)
		for {
			n, from, err := pc.ReadFrom(buf)
			if err != nil {
				return // closed
			}
			if resp := z.answer(buf[:n]); resp != nil {
				_, _ = pc.WriteTo(resp, from)
			}
		}
	}()
	t.Cleanup(func() { _ = pc.Close(); <-done })
	addr := pc.LocalAddr().String()
	return &net.Resolver{PreferGo: true, Dial: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "udp", addr)
	}}
}

// answer builds the response to one query, nil for a malformed one.
func (z *zone) answer(q []byte) []byte {
	if len(q) < 12 || binary.BigEndian.Uint16(q[4:]) != 1 {
		return nil
	}
	// The question: labels up to the root, then type and class.
	i := 12
	var labels []string
	for i < len(q) && q[i] != 0 {
		l := int(q[i])
		if l&0xC0 != 0 || i+1+l > len(q) {
			return nil
		}
		labels = append(labels, string(q[i+1:i+1+l]))
		i += 1 + l
	}
	if i+5 > len(q) {
		return nil
	}
	qend := i + 5
	qtype := binary.BigEndian.Uint16(q[i+1:])
	name := strings.ToLower(strings.Join(labels, "."))

	z.mu.Lock()
	rs, ok := z.names[name]
	var rcode int
	var rrs [][]byte
	switch {
	case !ok:
		rcode = rcodeNXDomain
	case rs.rcode != 0:
		rcode = rs.rcode
	default:
		for _, a := range rs.addrs {
			if (qtype == typeA && a.Is4()) || (qtype == typeAAAA && a.Is6()) {
				rrs = append(rrs, record(qtype, a.AsSlice()))
			}
		}
		if qtype == typeSRV {
			for _, s := range rs.srv {
				rd := binary.BigEndian.AppendUint16(nil, s.Priority)
				rd = binary.BigEndian.AppendUint16(rd, s.Weight)
				rd = binary.BigEndian.AppendUint16(rd, s.Port)
				rrs = append(rrs, record(typeSRV, appendName(rd, s.Target)))
			}
		}
	}
	z.mu.Unlock()

	flags := uint16(0x8000 | 0x0400 | 0x0080) // response, authoritative, recursion available
	flags |= binary.BigEndian.Uint16(q[2:]) & 0x0100
	flags |= uint16(rcode)
	resp := append([]byte(nil), q[:2]...)
	resp = binary.BigEndian.AppendUint16(resp, flags)
	resp = binary.BigEndian.AppendUint16(resp, 1)
	resp = binary.BigEndian.AppendUint16(resp, uint16(len(rrs)))
	resp = binary.BigEndian.AppendUint16(resp, 0)
	resp = binary.BigEndian.AppendUint16(resp, 0)
	resp = append(resp, q[12:qend]...)
	for _, rr := range rrs {
		resp = append(resp, rr...)
	}
	return resp
}

// record is one answer for the question's name (a pointer to offset 12).
func record(typ uint16, rdata []byte) []byte {
	b := []byte{0xC0, 12}
	b = binary.BigEndian.AppendUint16(b, typ)
	b = binary.BigEndian.AppendUint16(b, 1) // IN
	b = binary.BigEndian.AppendUint32(b, 5) // TTL
	b = binary.BigEndian.AppendUint16(b, uint16(len(rdata)))
	return append(b, rdata...)
}

func appendName(b []byte, name string) []byte {
	for _, l := range strings.Split(strings.TrimSuffix(name, "."), ".") {
		b = append(b, byte(len(l)))
		b = append(b, l...)
	}
	return append(b, 0)
}

// TestStandardResolver checks the source and the watcher against the
// standard library's DNS client talking to a real (tiny) DNS server:
// A/AAAA and SRV answers, and how NXDOMAIN, NODATA and SERVFAIL are told
// apart: the first two are an empty pool, the last keeps the last good set.
func TestStandardResolver(t *testing.T) {
	z := &zone{names: map[string]*rrset{}}
	res := serveDNS(t, z)
	ctx := context.Background()
	ip := netip.MustParseAddr

	z.set("d.test", &rrset{addrs: []netip.Addr{ip("10.0.0.2"), ip("fd00::1"), ip("10.0.0.1")}})
	d, err := discovery.NewDNS("d.test.:8200", discovery.WithResolver(res))
	require.NoError(t, err)
	eps, err := d.Resolve(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{"http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://[fd00::1]:8200"}, names(eps))

	z.set("a.test", &rrset{addrs: []netip.Addr{ip("10.0.1.1")}})
	z.set("b.test", &rrset{addrs: []netip.Addr{ip("10.0.1.2")}})
	z.set("_http._tcp.d.test", &rrset{srv: []*net.SRV{
		{Target: "a.test.", Port: 8200, Weight: 10}, {Target: "b.test.", Port: 8201, Weight: 10}}})
	s, err := discovery.NewDNS("_http._tcp.d.test.", discovery.WithResolver(res))
	require.NoError(t, err)
	eps, err = s.Resolve(ctx)
	require.NoError(t, err)
	assert.Equal(t, []string{"http://10.0.1.1:8200", "http://10.0.1.2:8201"}, names(eps))

	for _, tc := range []struct {
		name  string
		rs    *rrset
		empty bool
	}{
		{"NXDOMAIN", nil, true},
		{"NODATA", &rrset{}, true},
		{"SERVFAIL", &rrset{rcode: rcodeServFail}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, n := range []string{"d.test", "_http._tcp.d.test"} {
				z.set(n, tc.rs)
			}
			for _, src := range []*discovery.DNS{d, s} {
				_, err := src.Resolve(ctx)
				require.Error(t, err)
				assert.Equal(t, tc.empty, errors.Is(err, discovery.ErrNoRecords), "%s: %v", src, err)
				var de *net.DNSError
				if !tc.empty && assert.ErrorAs(t, err, &de) {
					assert.True(t, de.IsTemporary, "SERVFAIL is temporary")
				}
			}
		})
	}

	// The watcher over the same server: a set, a SERVFAIL (kept), NXDOMAIN
	// (emptied), records again.
	got := &applied{}
	w, err := discovery.NewWatcher(d, got.apply)
	require.NoError(t, err)
	z.set("d.test", &rrset{addrs: []netip.Addr{ip("10.0.0.1")}})
	require.NoError(t, w.Refresh(ctx))
	z.set("d.test", &rrset{rcode: rcodeServFail})
	require.Error(t, w.Refresh(ctx))
	z.set("d.test", nil)
	require.ErrorIs(t, w.Refresh(ctx), discovery.ErrNoRecords)
	z.set("d.test", &rrset{addrs: []netip.Addr{ip("10.0.0.3")}})
	require.NoError(t, w.Refresh(ctx))
	assert.Equal(t, [][]string{{"http://10.0.0.1:8200"}, {}, {"http://10.0.0.3:8200"}}, got.all())
	assert.Equal(t, discovery.WatchStats{Refreshes: 4, Changes: 3, Failures: 1, Empty: 1, Endpoints: 1}, w.Stats())
}
