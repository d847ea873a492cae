package redisstore_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention/redisstore"
)

// conformance runs the kvroute.Store suite on the deployment at url, with
// GETDEL and with GETDEL followed by WAIT 1.
func conformance(t *testing.T, url string) {
	for _, mode := range []struct {
		name string
		opts []redisstore.Option
	}{
		{"getdel", nil},
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
}

// TestSentinel runs the Store on a primary with replicas under Sentinel.
func TestSentinel(t *testing.T) {
	start := time.Now()
	s := startSentinels(t)
	t.Logf("sentinels ready in %v", time.Since(start))
	t.Run("Conformance", func(t *testing.T) { conformance(t, s.URL()) })
}
