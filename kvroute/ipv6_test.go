package kvroute_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// TestIPv6Loopback runs the 2P2D conversation with a fault on engines and
// a router listening on [::1].
func TestIPv6Loopback(t *testing.T) {
	ln, err := net.Listen("tcp", "[::1]:0")
	if err != nil {
		t.Skipf("no IPv6 loopback: %v", err)
	}
	c := kvroutetest.NewCluster(t, 2, 2, kvroutetest.WithListenAddress("[::1]:0"))
	for _, e := range append(append([]*kvroutetest.Engine(nil), c.Prefill...), c.Decode...) {
		require.True(t, strings.HasPrefix(e.URL(), "http://[::1]:"), e.URL())
	}
	obs := &kvroutetest.Records{}
	r := newRouter(t, c, kvroute.WithObserver(obs))
	srv := httptest.NewUnstartedServer(leakGuard{t: t, h: r})
	srv.Listener.Close()
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	g := &rig{t: t, c: c, r: r, url: srv.URL, obs: obs,
		conv: &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}}
	for i := 1; i <= 6; i++ {
		if i == 4 {
			g.lastDecode().Close()
			g.n.faults++
		}
		res := g.turn(i, false)
		if i > 1 && i != 4 {
			assert.Equal(t, kvroute.ReuseHit, kvroute.ReuseOutcome(res.header.Get("X-Bidikv-Reuse")), "turn %d", i)
		}
		assert.Equal(t, http.StatusOK, res.status)
	}
	g.finish()
}
