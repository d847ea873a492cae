package discovery_test

import (
	"context"
	"net"
	"net/url"
	"strconv"
	"testing"

	"github.com/bidikv/bidikv/transport/discovery"
)

// anyDNS answers every name: two addresses for A/AAAA, one SRV record.
type anyDNS struct{ port uint16 }

func (anyDNS) LookupHost(context.Context, string) ([]string, error) {
	return []string{"10.0.0.7", "fd00::7"}, nil
}

func (a anyDNS) LookupSRV(_ context.Context, _, _, name string) (string, []*net.SRV, error) {
	return name, []*net.SRV{{Target: "engine-0.d.test.", Port: a.port, Priority: 1, Weight: 1}}, nil
}

// FuzzNewDNS feeds NewDNS operator-written names (flags, manifests): it
// must never panic, and a name it accepts must resolve to endpoints whose
// URLs are http(s)://host:port with a port the name or the SRV record gave.
func FuzzNewDNS(f *testing.F) {
	for _, s := range []string{
		"vllm-decode.llm.svc.cluster.local:8000", "http://d.test:8000", "https://d.test:443",
		"_http._tcp.vllm-decode.llm.svc.cluster.local", "_http._tcp.d.test.", "[::1]:8000", "127.0.0.1:8100",
		"", "d.test", "d.test:0", "d.test:70000", "ftp://d.test:21", "http://d.test:8000/prefix",
		"user@d.test:8000", "_http._tcp.d.test:8000", "_http.test", "http://", "[fe80::1%eth0]:80", " d.test:1 ",
	} {
		f.Add(s, uint16(8200), 1)
	}
	f.Fuzz(func(t *testing.T, name string, srvPort uint16, dp int) {
		dp = 1 + (dp&7+8)%8 // 1..8
		d, err := discovery.NewDNS(name, discovery.WithResolver(anyDNS{port: srvPort}), discovery.WithDPSize(dp))
		if err != nil {
			return
		}
		eps, err := d.Resolve(context.Background())
		if err != nil {
			return // e.g. an SRV record with port 0
		}
		for _, ep := range eps {
			u, err := url.Parse(ep.URL.String()) // what the router will send to
			if err != nil {
				t.Fatalf("%q: endpoint URL %q: %v", name, ep.URL, err)
			}
			if u.Scheme != "http" && u.Scheme != "https" {
				t.Fatalf("%q: endpoint URL %q: scheme %q", name, ep.URL, u.Scheme)
			}
			p, err := strconv.Atoi(u.Port())
			if err != nil || p < 1 || p > 65535 || u.Hostname() == "" || u.Path != "" {
				t.Fatalf("%q: endpoint URL %q is not scheme://host:port", name, ep.URL)
			}
		}
	})
}
