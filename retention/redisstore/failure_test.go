package redisstore_test

import (
	"context"
	"log/slog"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/redisstore"
)

// hangLimit is far above any timeout a test sets: a call still running
// after it is hung, not slow.
const hangLimit = 20 * time.Second

// noHang runs f and fails the test if f has not returned after hangLimit.
// It catches a hang; it does not measure speed.
func noHang(t *testing.T, what string, f func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); f() }()
	select {
	case <-done:
	case <-time.After(hangLimit):
		t.Fatalf("%s: still running after %v", what, hangLimit)
	}
}

// waitRecovered takes key until a call succeeds, bounded, and returns the
// number of calls that failed meanwhile.
func waitRecovered(t *testing.T, s *redisstore.Store) int {
	t.Helper()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for i := range 1000 { // about 10 s; go-redis redials once a second
		_, _, err := s.Take(t.Context(), "probe")
		if err == nil {
			return i
		}
		<-tick.C
	}
	t.Fatal("the store did not recover after the server came back")
	return 0
}

func TestServerKilled(t *testing.T) {
	srv := startServer(t)
	logs := &logRecorder{}
	// A long timeout: a dead Redis must fail the call at once (refused
	// connection, no retries), not when the timeout runs out.
	s := newStore(t, srv, redisstore.WithLogger(slog.New(logs)), redisstore.WithTimeout(time.Minute))
	ctx := t.Context()
	require.NoError(t, s.Put(ctx, "k", []byte("before"), time.Hour), "warm the pool")

	srv.kill()
	const calls = 10
	for i := range calls {
		noHang(t, "Take", func() {
			got, ok, err := s.Take(ctx, "k")
			assert.Error(t, err, "take %d", i)
			assert.NotErrorIs(t, err, context.DeadlineExceeded, "take %d", i)
			assert.False(t, ok)
			assert.Nil(t, got)
		})
		noHang(t, "Put", func() {
			err := s.Put(ctx, "k", []byte("during"), time.Hour)
			assert.Error(t, err, "put %d", i)
			assert.NotErrorIs(t, err, context.DeadlineExceeded, "put %d", i)
		})
	}
	st := s.Stats()
	assert.Equal(t, int64(calls), st.TakeErrors)
	assert.Equal(t, int64(calls), st.PutErrors)
	require.Equal(t, []string{"WARN redisstore: redis failing; takes miss and puts are dropped until it answers again"},
		logs.messages(), "one warning per outage, not one per call")

	srv.restart()
	failed := waitRecovered(t, s)
	require.NoError(t, s.Put(ctx, "k", []byte("after"), time.Hour))
	got, ok, err := s.Take(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, []byte("after"), got)

	msgs := logs.messages()
	require.Len(t, msgs, 2)
	assert.Equal(t, "INFO redisstore: redis answering again", msgs[1])
	assert.Equal(t, int64(2*calls+failed), logs.attr(1, "failed_calls"))
	st = s.Stats()
	assert.Equal(t, int64(2*calls+failed), st.TakeErrors+st.PutErrors)
}

// TestServerPaused freezes the server: the kernel still accepts and buffers
// commands but nothing answers. Only the Store's timeout can end the call,
// since the client's own read and write timeouts are an hour.
func TestServerPaused(t *testing.T) {
	srv := startServer(t)
	client := redis.NewClient(&redis.Options{
		Addr: srv.Addr(), ContextTimeoutEnabled: true,
		ReadTimeout: time.Hour, WriteTimeout: time.Hour, DialTimeout: time.Hour,
	})
	t.Cleanup(func() { _ = client.Close() })
	s, err := redisstore.New(client) // DefaultTimeout
	require.NoError(t, err)
	ctx := t.Context()
	require.NoError(t, s.Put(ctx, "k", []byte("v"), time.Hour), "warm the pool")

	resume := srv.pause()
	t.Cleanup(resume)
	noHang(t, "Take", func() {
		_, ok, err := s.Take(ctx, "k")
		assert.ErrorIs(t, err, context.DeadlineExceeded)
		assert.False(t, ok)
	})
	noHang(t, "Put", func() {
		assert.ErrorIs(t, s.Put(ctx, "k2", []byte("v"), time.Hour), context.DeadlineExceeded)
	})
	assert.Equal(t, redisstore.Stats{Puts: 1, TakeErrors: 1, PutErrors: 1}, s.Stats())

	// A caller's shorter deadline is the caller's, not an outage.
	short, cancel := context.WithTimeout(ctx, time.Millisecond)
	defer cancel()
	noHang(t, "Take with a short deadline", func() {
		_, _, err := s.Take(short, "k")
		assert.ErrorIs(t, err, context.DeadlineExceeded)
	})
	assert.Equal(t, int64(1), s.Stats().Canceled)

	resume()
	waitRecovered(t, s)
	require.NoError(t, s.Put(ctx, "k3", []byte("v3"), time.Hour))
	got, ok, err := s.Take(ctx, "k3")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, []byte("v3"), got)
}
