package redisstore_test

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
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

// untilRecovered makes successful calls until the store logs that Redis
// answers again, bounded, and returns the records logged so far.
func untilRecovered(t *testing.T, s *redisstore.Store, logs *logRecorder) []string {
	t.Helper()
	deadline := time.Now().Add(hangLimit)
	for time.Now().Before(deadline) {
		if msgs := logs.messages(); len(msgs) > 0 && msgs[len(msgs)-1] == "INFO redisstore: redis answering again" {
			return msgs
		}
		_, _, err := s.Take(t.Context(), "probe")
		require.NoError(t, err, "Redis is back: calls must succeed")
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatalf("no recovery record within %v: %q", hangLimit, logs.messages())
	return nil
}

// TestServerKilled kills Redis under concurrent load, then restarts it: the
// logger gets one warning and one recovery record, however many calls fail
// and from however many goroutines, and the recovery record and Stats count
// every failed call.
func TestServerKilled(t *testing.T) {
	srv := startServer(t)
	logs := &logRecorder{}
	const window = 200 * time.Millisecond
	// A long timeout: a dead Redis must fail the call at once (refused
	// connection, no retries), not when the timeout runs out.
	s := newStore(t, srv, redisstore.WithLogger(slog.New(logs)), redisstore.WithTimeout(time.Minute),
		redisstore.WithRecoveryWindow(window))
	ctx := t.Context()
	require.NoError(t, s.Put(ctx, "k", []byte("before"), time.Hour), "warm the pool")

	srv.kill()
	start := time.Now()
	_, _, err := s.Take(ctx, "k")
	require.Error(t, err)
	firstFailed := time.Now()
	const (
		workers = 8
		calls   = 100 // per worker, each a Take and a Put
	)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range calls {
				noHang(t, "Take", func() {
					got, ok, err := s.Take(ctx, fmt.Sprintf("k%d", w))
					assert.Error(t, err, "take %d", i)
					assert.NotErrorIs(t, err, context.DeadlineExceeded, "take %d", i)
					assert.False(t, ok)
					assert.Nil(t, got)
				})
				noHang(t, "Put", func() {
					err := s.Put(ctx, fmt.Sprintf("k%d", w), []byte("during"), time.Hour)
					assert.Error(t, err, "put %d", i)
					assert.NotErrorIs(t, err, context.DeadlineExceeded, "put %d", i)
				})
			}
		})
	}
	wg.Wait()
	const failedBefore = 1 + 2*workers*calls
	st := s.Stats()
	assert.Equal(t, int64(1+workers*calls), st.TakeErrors)
	assert.Equal(t, int64(workers*calls), st.PutErrors)
	assert.Equal(t, int64(1), st.Outages)
	assert.Equal(t, int64(failedBefore), st.OutageFailedCalls)
	assert.False(t, st.OutageSince.Before(start) || st.OutageSince.After(firstFailed), "OutageSince %v", st.OutageSince)
	require.Equal(t, []string{"WARN redisstore: redis failing; takes miss and puts are dropped until it answers again"},
		logs.messages(), "one warning per outage, not one per call")
	assert.Contains(t, logs.attr(0, "err"), "connection refused")
	assert.Equal(t, "take", logs.attr(0, "op"))

	srv.restart()
	restarted := time.Now()
	failed := waitRecovered(t, s)
	back := time.Now() // after the first successful call
	require.NoError(t, s.Put(ctx, "k", []byte("after"), time.Hour))
	got, ok, err := s.Take(ctx, "k")
	require.NoError(t, err)
	require.True(t, ok)
	assert.Equal(t, []byte("after"), got)

	msgs := untilRecovered(t, s, logs)
	require.Equal(t, []string{
		"WARN redisstore: redis failing; takes miss and puts are dropped until it answers again",
		"INFO redisstore: redis answering again",
	}, msgs, "one record when the outage starts, one when it ends")
	total := int64(failedBefore + failed)
	assert.Equal(t, total, logs.attr(1, "failed_calls"))
	outage, _ := logs.attr(1, "outage").(time.Duration)
	assert.GreaterOrEqual(t, outage, restarted.Sub(firstFailed), "the outage lasted at least until Redis was back")
	assert.LessOrEqual(t, outage, back.Sub(start), "the outage ends at the first success, not at the record")

	st = s.Stats()
	assert.Equal(t, total, st.TakeErrors+st.PutErrors)
	assert.Equal(t, int64(1), st.Outages)
	assert.Zero(t, st.OutageFailedCalls)
	assert.True(t, st.OutageSince.IsZero())
	assert.Equal(t, total, st.LastOutageFailedCalls)
	assert.Equal(t, outage, st.LastOutageDuration)
}

// TestServerOutOfMemory runs turns against a Redis whose writes fail while
// its reads answer (maxmemory reached with noeviction): every Put fails and
// every Take succeeds. That is one outage, logged once, not a warning and a
// recovery on every turn; it ends once Puts succeed again for the window.
func TestServerOutOfMemory(t *testing.T) {
	srv := startServer(t)
	raw := srv.client(t)
	ctx := t.Context()
	logs := &logRecorder{}
	const window = 200 * time.Millisecond
	s := newStore(t, srv, redisstore.WithLogger(slog.New(logs)), redisstore.WithTimeout(10*time.Second),
		redisstore.WithRecoveryWindow(window))
	require.NoError(t, raw.ConfigSet(ctx, "maxmemory", "1").Err())
	t.Cleanup(func() { _ = raw.ConfigSet(context.Background(), "maxmemory", "0").Err() })

	const turns = 500
	for i := range turns {
		_, ok, err := s.Take(ctx, fmt.Sprint("conv", i))
		require.NoError(t, err, "GETDEL is allowed when Redis is out of memory")
		require.False(t, ok)
		require.Error(t, s.Put(ctx, fmt.Sprint("conv", i+1), []byte("handle"), time.Hour), "SET is refused")
	}
	require.Equal(t, []string{"WARN redisstore: redis failing; takes miss and puts are dropped until it answers again"},
		logs.messages(), "one warning for the outage, none per turn")
	assert.Contains(t, logs.attr(0, "err"), "OOM")
	assert.NotContains(t, logs.attr(0, "err"), "conv", "no key in the record")
	st := s.Stats()
	assert.Equal(t, int64(turns), st.PutErrors)
	assert.Equal(t, int64(turns), st.OutageFailedCalls)

	require.NoError(t, raw.ConfigSet(ctx, "maxmemory", "0").Err())
	require.NoError(t, s.Put(ctx, "conv", []byte("handle"), time.Hour))
	msgs := untilRecovered(t, s, logs)
	require.Len(t, msgs, 2)
	assert.Equal(t, int64(turns), logs.attr(1, "failed_calls"))
	st = s.Stats()
	assert.Equal(t, int64(1), st.Outages)
	assert.Equal(t, int64(turns), st.LastOutageFailedCalls)
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
	st := s.Stats()
	assert.Equal(t, redisstore.Stats{Puts: 1, TakeErrors: 1, PutErrors: 1, Outages: 1, OutageFailedCalls: 2, OutageSince: st.OutageSince}, st)
	assert.False(t, st.OutageSince.IsZero())

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
