package redisstore_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention/redisstore"
)

// conformance runs the kvroute.Store suite on the deployment at url, with
// GETDEL, with the Lua script (one key: KEYS[1], on the key's slot), and
// with GETDEL followed by WAIT 1.
func conformance(t *testing.T, url string) {
	for _, mode := range []struct {
		name string
		opts []redisstore.Option
	}{
		{"getdel", nil},
		{"script", []redisstore.Option{redisstore.WithScriptTake()}},
		{"wait", []redisstore.Option{redisstore.WithWaitReplicas(1)}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			kvroutetest.TestStore(t, func(t *testing.T) kvroute.Store {
				opts := append([]redisstore.Option{redisstore.WithTimeout(10 * time.Second)}, mode.opts...)
				s, err := redisstore.NewFromURL(url, opts...)
				require.NoError(t, err)
				t.Cleanup(func() { _ = s.Close() })
				return s
			})
		})
	}
}

// TestCluster runs the Store on a Redis Cluster of three primaries.
func TestCluster(t *testing.T) {
	start := time.Now()
	c := startCluster(t)
	t.Logf("cluster formed in %v", time.Since(start))
	t.Run("Conformance", func(t *testing.T) { conformance(t, c.URL()) })
	// The first shard's primary has two replicas: after it fails, the
	// promoted one still has a replica to acknowledge deletes.
	t.Run("FailoverWait", func(t *testing.T) {
		res := failoverUnderLoad(t, c.URL(), []redisstore.Option{redisstore.WithWaitReplicas(1)},
			func() { c.nodes[0].kill() }, func() { c.waitPromoted(t, 0) })
		t.Logf("cluster, WithWaitReplicas(1), primary 0 killed: %v", res)
		assert.Zero(t, res.doubleTakes, "handles taken twice")
	})
	c.waitHealthy(t)
	// GETDEL alone: double takes are counted, not asserted, since the store
	// does not rule them out (TestUnreplicatedDelete shows the window).
	t.Run("FailoverGetdel", func(t *testing.T) {
		res := failoverUnderLoad(t, c.URL(), nil,
			func() { c.nodes[1].kill() }, func() { c.waitPromoted(t, 1) })
		t.Logf("cluster, GETDEL only, primary 1 killed: %v", res)
	})
	// Last: it leaves the third shard without a replica.
	c.waitHealthy(t)
	t.Run("Routers", func(t *testing.T) { routersThroughFailover(t, c) })
}

// TestSentinel runs the Store on a primary with replicas under Sentinel.
func TestSentinel(t *testing.T) {
	start := time.Now()
	s := startSentinels(t)
	t.Logf("sentinels ready in %v", time.Since(start))
	t.Run("Conformance", func(t *testing.T) { conformance(t, s.URL()) })
	// Two replicas: after the first failover the new primary still has
	// one to acknowledge deletes.
	t.Run("FailoverWait", func(t *testing.T) {
		p := s.primary(t)
		res := failoverUnderLoad(t, s.URL(), []redisstore.Option{redisstore.WithWaitReplicas(1)},
			func() { s.servers[p].kill() }, func() { s.primary(t) })
		t.Logf("sentinel, WithWaitReplicas(1), primary killed: %v", res)
		assert.Zero(t, res.doubleTakes, "handles taken twice")
	})
	// GETDEL alone: double takes counted, not asserted (see TestCluster).
	t.Run("FailoverGetdel", func(t *testing.T) {
		p := s.primary(t)
		res := failoverUnderLoad(t, s.URL(), nil,
			func() { s.servers[p].kill() }, func() { s.primary(t) })
		t.Logf("sentinel, GETDEL only, primary killed: %v", res)
	})
}

// routersThroughFailover runs conversations through three router replicas
// sharing the cluster and kills the third shard's primary during a round:
// no client sees an error (a turn whose Take or Put fails runs as a miss),
// no engine reads blocks twice, and every conversation hits again once the
// replica has taken over.
func routersThroughFailover(t *testing.T, c *redisCluster) {
	const (
		killAt    = 4  // the round during which the primary goes away
		maxRounds = 40 // after the kill; the failover takes a few seconds
	)
	stores := make([]*redisstore.Store, 3)
	for i := range stores {
		s, err := redisstore.NewFromURL(c.URL(), redisstore.WithTimeout(2*time.Second))
		require.NoError(t, err)
		t.Cleanup(func() { _ = s.Close() })
		stores[i] = s
	}
	f := newFleet(t, asStores(stores))
	convs := newConversations()
	for n := 1; n < killAt; n++ {
		hits, _, failed := f.round(t, convs, n)
		require.Zero(t, failed, "turn %d", n)
		assert.Equal(t, min(n-1, 1)*e2eConversations, hits, "turn %d", n)
	}
	killed := make(chan struct{})
	go func() { defer close(killed); c.nodes[2].kill() }()
	_, _, failed := f.round(t, convs, killAt)
	<-killed
	require.Zero(t, failed, "primary killed mid-round: a client saw an error")

	missed, resumed := 0, false
	for n := killAt + 1; n <= killAt+maxRounds && !resumed; n++ {
		hits, misses, failed := f.round(t, convs, n)
		require.Zero(t, failed, "turn %d, during the failover: a client saw an error", n)
		missed += misses
		resumed = hits == e2eConversations && missed > 0
		time.Sleep(100 * time.Millisecond)
	}
	require.True(t, resumed, "hits did not resume within %d rounds after the kill (%d misses)", maxRounds, missed)
	f.checkEngines(t)
	t.Logf("routers: %d turns missed during the failover, then every conversation hit", missed)
}
