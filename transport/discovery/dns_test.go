package discovery_test

import (
	"context"
	"net"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport"
	"github.com/bidikv/bidikv/transport/discovery"
)

func names(eps []transport.Endpoint) []string {
	out := make([]string, len(eps))
	for i, ep := range eps {
		out[i] = ep.String()
	}
	return out
}

func TestNewDNSNames(t *testing.T) {
	for _, ok := range []string{
		"vllm-decode.llm.svc.cluster.local:8000", "http://d.test:8000", "https://d.test:443",
		"_http._tcp.vllm-decode.llm.svc.cluster.local", "_http._tcp.d.test.", "[::1]:8000", "127.0.0.1:8100",
	} {
		_, err := discovery.NewDNS(ok)
		assert.NoError(t, err, ok)
	}
	for _, bad := range []string{
		"", "d.test", "d.test:", "d.test:0", "d.test:70000", "d.test:http", ":8000", "ftp://d.test:21",
		"http://d.test:8000/prefix", "d.test:8000?x=1", "user@d.test:8000", "_http._tcp.d.test:8000", "_http.test",
		"http://",
	} {
		_, err := discovery.NewDNS(bad)
		assert.ErrorIs(t, err, discovery.ErrInvalidConfig, "%q", bad)
	}
	_, err := discovery.NewDNS("d.test:8000", discovery.WithDPSize(0))
	assert.ErrorIs(t, err, discovery.ErrInvalidConfig)
	_, err = discovery.NewDNS("d.test:8000", discovery.WithResolver(nil))
	assert.ErrorIs(t, err, discovery.ErrInvalidConfig)
}

func TestResolveHost(t *testing.T) {
	dns := newFakeDNS()
	dns.setHost("d.test", "10.0.0.2", "fd00::1", "10.0.0.1")
	d, err := discovery.NewDNS("d.test:8200", discovery.WithResolver(dns))
	require.NoError(t, err)
	eps, err := d.Resolve(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{"http://10.0.0.1:8200", "http://10.0.0.2:8200", "http://[fd00::1]:8200"}, names(eps))
	for _, ep := range eps {
		assert.Equal(t, transport.NoRank, ep.Rank)
		assert.Equal(t, 1, ep.Weight)
	}

	t.Run("ranks", func(t *testing.T) {
		d, err := discovery.NewDNS("https://d.test:8200", discovery.WithResolver(dns), discovery.WithDPSize(2))
		require.NoError(t, err)
		eps, err := d.Resolve(context.Background())
		require.NoError(t, err)
		assert.Equal(t, []string{
			"https://10.0.0.1:8200 (rank 0)", "https://10.0.0.1:8200 (rank 1)",
			"https://10.0.0.2:8200 (rank 0)", "https://10.0.0.2:8200 (rank 1)",
			"https://[fd00::1]:8200 (rank 0)", "https://[fd00::1]:8200 (rank 1)",
		}, names(eps))
	})

	t.Run("not found", func(t *testing.T) {
		d, err := discovery.NewDNS("gone.test:8200", discovery.WithResolver(dns))
		require.NoError(t, err)
		_, err = d.Resolve(context.Background())
		assert.ErrorIs(t, err, discovery.ErrNoRecords)
		dns.setHost("empty.test", []string{}...)
		d, err = discovery.NewDNS("empty.test:8200", discovery.WithResolver(dns))
		require.NoError(t, err)
		_, err = d.Resolve(context.Background())
		assert.ErrorIs(t, err, discovery.ErrNoRecords, "an empty answer")
	})

	t.Run("temporary failure", func(t *testing.T) {
		dns.setFail(errServFail)
		defer dns.setFail(nil)
		_, err := d.Resolve(context.Background())
		require.Error(t, err)
		assert.NotErrorIs(t, err, discovery.ErrNoRecords, "SERVFAIL is no answer, not an empty one")
		var de *net.DNSError
		assert.ErrorAs(t, err, &de)
	})
}

func TestResolveSRV(t *testing.T) {
	dns := newFakeDNS()
	dns.setHost("a.test", "10.0.0.1")
	dns.setHost("b.test", "10.0.0.2")
	dns.setHost("c.test", "10.0.0.3")
	name := "_http._tcp.d.test"
	d, err := discovery.NewDNS(name, discovery.WithResolver(dns))
	require.NoError(t, err)

	dns.setSRV(name,
		&net.SRV{Target: "b.test.", Port: 8201, Priority: 0, Weight: 50},
		&net.SRV{Target: "a.test.", Port: 8200, Priority: 0, Weight: 50},
		&net.SRV{Target: "c.test.", Port: 8202, Priority: 10, Weight: 50},   // a fallback: not used
		&net.SRV{Target: "gone.test.", Port: 8203, Priority: 0, Weight: 50}, // no address: skipped
	)
	eps, err := d.Resolve(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{"http://10.0.0.1:8200", "http://10.0.0.2:8201"}, names(eps))
	assert.Equal(t, []int{1, 1}, []int{eps[0].Weight, eps[1].Weight}, "equal SRV weights: equal endpoints")

	dns.setSRV(name, &net.SRV{Target: "a.test.", Port: 8200, Weight: 3}, &net.SRV{Target: "b.test.", Port: 8201, Weight: 0})
	eps, err = d.Resolve(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []int{3, 1}, []int{eps[0].Weight, eps[1].Weight}, "unequal SRV weights carry over, 0 as 1")

	dns.setSRV(name, &net.SRV{Target: ".", Port: 0})
	_, err = d.Resolve(context.Background())
	assert.ErrorIs(t, err, discovery.ErrNoRecords, `target "." means no service`)

	dns.setSRV(name)
	_, err = d.Resolve(context.Background())
	assert.ErrorIs(t, err, discovery.ErrNoRecords)
}

// TestResolveSystem resolves through the standard library's resolver: an
// IP literal needs no DNS server.
func TestResolveSystem(t *testing.T) {
	d, err := discovery.NewDNS("127.0.0.1:8100", discovery.WithResolver(&net.Resolver{}))
	require.NoError(t, err)
	eps, err := d.Resolve(context.Background())
	require.NoError(t, err)
	assert.Equal(t, []string{"http://127.0.0.1:8100"}, names(eps))
}
