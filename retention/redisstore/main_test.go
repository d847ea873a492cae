package redisstore_test

import (
	"context"
	"testing"

	"github.com/redis/go-redis/v9"
	"go.uber.org/goleak"
)

// quiet discards go-redis's own log lines (a failed dial per call while a
// test's server is down), which a program would route with redis.SetLogger.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

func TestMain(m *testing.M) {
	redis.SetLogger(quiet{})
	goleak.VerifyTestMain(m,
		// go-redis probes an unreachable server from this goroutine once a
		// second after dials fail; it returns at its next probe once the
		// client is closed.
		goleak.IgnoreAnyFunction("github.com/redis/go-redis/v9/internal/pool.(*ConnPool).tryDial"),
	)
}
