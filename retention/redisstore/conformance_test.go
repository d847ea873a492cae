package redisstore_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention/redisstore"
)

// TestStore runs the kvroute.Store conformance suite against one
// redis-server, every subtest with Stores of their own on the same database,
// as router replicas would share it.
func TestStore(t *testing.T) {
	srv := startServer(t)
	for _, mode := range []struct {
		name string
		opts []redisstore.Option
	}{
		{"getdel", nil},
		{"script", []redisstore.Option{redisstore.WithScriptTake()}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			kvroutetest.TestStore(t, func(t *testing.T) kvroute.Store {
				// The suite checks the contract, not latency: a cold pool
				// serving 100 racing takers on a loaded machine may need
				// more than the default 50 ms.
				opts := append([]redisstore.Option{redisstore.WithTimeout(10 * time.Second)}, mode.opts...)
				s, err := redisstore.NewFromURL(srv.URL(), opts...)
				require.NoError(t, err)
				t.Cleanup(func() { _ = s.Close() })
				return s
			})
		})
	}
}
