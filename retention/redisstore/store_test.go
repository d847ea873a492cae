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

	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/retention/redisstore"
)

// newStore returns a Store on srv with its own client.
func newStore(t testing.TB, srv *server, opts ...redisstore.Option) *redisstore.Store {
	t.Helper()
	s, err := redisstore.NewFromURL(srv.URL(), opts...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = s.Close() })
	return s
}

func TestPutTake(t *testing.T) {
	srv := startServer(t)
	raw := srv.client(t)
	s := newStore(t, srv)
	ctx := t.Context()

	value := []byte("{\"a\":1}\r\n\x00\xff")
	require.NoError(t, s.Put(ctx, "conv", value, time.Hour))
	stored, err := raw.Get(ctx, "bidikv:conv").Bytes()
	require.NoError(t, err, "the value is under the default prefix")
	assert.Equal(t, value, stored)

	got, ok, err := s.Take(ctx, "conv")
	require.NoError(t, err)
	assert.True(t, ok)
	assert.Equal(t, value, got)

	got, ok, err = s.Take(ctx, "conv")
	require.NoError(t, err)
	assert.False(t, ok, "a second Take must miss")
	assert.Nil(t, got)
	assert.Zero(t, raw.Exists(ctx, "bidikv:conv").Val(), "Take deletes the key")

	assert.Equal(t, redisstore.Stats{Hits: 1, Misses: 1, Puts: 1}, s.Stats())
}

func TestTTL(t *testing.T) {
	srv := startServer(t)
	raw := srv.client(t)
	s := newStore(t, srv)
	ctx := t.Context()

	tests := []struct {
		name     string
		ttl      time.Duration
		min, max time.Duration // bounds on the PTTL Redis reports
	}{
		{"retention default", 450 * time.Second, 440 * time.Second, 450 * time.Second},
		{"sub-second", 1500 * time.Millisecond, time.Second, 1500 * time.Millisecond},
		{"rounded up to 1ms", time.Microsecond, 0, time.Millisecond},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			key := "ttl:" + tt.name
			require.NoError(t, s.Put(ctx, key, []byte("v"), tt.ttl))
			pttl, err := raw.PTTL(ctx, s.Key(key)).Result()
			require.NoError(t, err)
			if pttl == -2*time.Nanosecond { // gone already: only for the 1ms case
				require.Equal(t, time.Microsecond, tt.ttl, "key %q missing", key)
				return
			}
			assert.GreaterOrEqual(t, pttl, tt.min)
			assert.LessOrEqual(t, pttl, tt.max)
		})
	}

	t.Run("expires", func(t *testing.T) {
		require.NoError(t, s.Put(ctx, "short", []byte("v"), time.Millisecond))
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		gone := false
		for range 5000 { // at most about 5 s
			if raw.Exists(ctx, s.Key("short")).Val() == 0 {
				gone = true
				break
			}
			<-tick.C
		}
		require.True(t, gone, "a key stored with PX 1 did not expire")
		_, ok, err := s.Take(ctx, "short")
		require.NoError(t, err)
		assert.False(t, ok)
	})
}

func TestPutRejects(t *testing.T) {
	srv := startServer(t)
	raw := srv.client(t)
	ctx := t.Context()
	small := newStore(t, srv, redisstore.WithPrefix("small:"), redisstore.WithMaxValueBytes(4))
	// The default bound is 8 MiB: give a value that large time to cross
	// loopback on a loaded machine under -race.
	def := newStore(t, srv, redisstore.WithTimeout(10*time.Second))

	tests := []struct {
		name  string
		s     *redisstore.Store
		value []byte
		ttl   time.Duration
		want  error
	}{
		{"zero ttl", def, []byte("v"), 0, redisstore.ErrInvalidTTL},
		{"negative ttl", def, []byte("v"), -time.Second, redisstore.ErrInvalidTTL},
		{"over default bound", def, make([]byte, redisstore.DefaultMaxValueBytes+1), time.Hour, redisstore.ErrValueTooLarge},
		{"over custom bound", small, []byte("12345"), time.Hour, redisstore.ErrValueTooLarge},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			key := "reject:" + tt.name
			err := tt.s.Put(ctx, key, tt.value, tt.ttl)
			assert.ErrorIs(t, err, tt.want)
			if tt.want == redisstore.ErrValueTooLarge {
				assert.ErrorIs(t, err, retention.ErrTooLarge, "the router counts it as a handle too large, not a store failure")
			}
			assert.Zero(t, raw.Exists(ctx, tt.s.Key(key)).Val(), "nothing reaches Redis")
		})
	}
	assert.Equal(t, int64(3), def.Stats().Rejected)
	assert.Equal(t, int64(1), small.Stats().Rejected)

	t.Run("at the bound", func(t *testing.T) {
		require.NoError(t, def.Put(ctx, "max", make([]byte, redisstore.DefaultMaxValueBytes), time.Hour))
		require.NoError(t, small.Put(ctx, "max", []byte("1234"), time.Hour))
		got, ok, err := small.Take(ctx, "max")
		require.NoError(t, err)
		require.True(t, ok)
		assert.Equal(t, []byte("1234"), got)
		got, ok, err = def.Take(ctx, "max")
		require.NoError(t, err)
		require.True(t, ok)
		assert.Len(t, got, redisstore.DefaultMaxValueBytes)
	})
}

func TestPrefix(t *testing.T) {
	srv := startServer(t)
	raw := srv.client(t)
	ctx := t.Context()
	a := newStore(t, srv, redisstore.WithPrefix("a:"))
	b := newStore(t, srv, redisstore.WithPrefix("b:"))
	bare := newStore(t, srv, redisstore.WithPrefix(""))

	require.NoError(t, a.Put(ctx, "k", []byte("from a"), time.Hour))
	require.NoError(t, b.Put(ctx, "k", []byte("from b"), time.Hour))
	require.NoError(t, bare.Put(ctx, "k", []byte("bare"), time.Hour))
	keys, err := raw.Keys(ctx, "*").Result()
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"a:k", "b:k", "k"}, keys)

	for _, tc := range []struct {
		s    *redisstore.Store
		want string
	}{{b, "from b"}, {a, "from a"}, {bare, "bare"}} {
		got, ok, err := tc.s.Take(ctx, "k")
		require.NoError(t, err)
		require.True(t, ok, "prefix %q", tc.s.Key(""))
		assert.Equal(t, tc.want, string(got), "prefix %q", tc.s.Key(""))
	}
}

// TestOneWinner races 100 takers spread over three Stores, each with its own
// client as separate router replicas would have, for each of many handles.
func TestOneWinner(t *testing.T) {
	for _, mode := range []struct {
		name string
		opts []redisstore.Option
		args []string
	}{
		{"getdel", nil, nil},
		{"script", []redisstore.Option{redisstore.WithScriptTake()}, nil},
		{"fallback", nil, []string{"--rename-command", "GETDEL", ""}},
	} {
		t.Run(mode.name, func(t *testing.T) {
			const (
				rounds = 20
				takers = 100
			)
			srv := startServer(t, mode.args...)
			stores := make([]*redisstore.Store, 3)
			// The race is the point, not latency: a cold pool dialing 100
			// connections on a loaded machine may need more than 50 ms.
			opts := append([]redisstore.Option{redisstore.WithTimeout(10 * time.Second)}, mode.opts...)
			for i := range stores {
				stores[i] = newStore(t, srv, opts...)
			}
			ctx := t.Context()
			for round := range rounds {
				key := fmt.Sprint("handle-", round)
				want := fmt.Appendf(nil, "value %d", round)
				require.NoError(t, stores[round%3].Put(ctx, key, want, time.Hour))

				var wins, errs sync.Map
				start := make(chan struct{})
				var wg sync.WaitGroup
				for i := range takers {
					wg.Go(func() {
						<-start
						got, ok, err := stores[i%3].Take(ctx, key)
						switch {
						case err != nil:
							errs.Store(i, err)
						case ok:
							wins.Store(i, got)
						}
					})
				}
				close(start)
				wg.Wait()

				errs.Range(func(i, err any) bool { t.Errorf("round %d taker %d: %v", round, i, err); return true })
				n := 0
				wins.Range(func(_, got any) bool {
					n++
					assert.Equal(t, want, got)
					return true
				})
				require.Equal(t, 1, n, "round %d: winners", round)
			}
			var hits, misses int64
			for _, s := range stores {
				hits += s.Stats().Hits
				misses += s.Stats().Misses
			}
			assert.Equal(t, int64(rounds), hits)
			assert.Equal(t, int64(rounds*(takers-1)), misses)
		})
	}
}

func TestScriptFallback(t *testing.T) {
	srv := startServer(t, "--rename-command", "GETDEL", "")
	logs := &logRecorder{}
	s := newStore(t, srv, redisstore.WithLogger(slog.New(logs)))
	ctx := t.Context()

	for i := range 3 {
		require.NoError(t, s.Put(ctx, "k", []byte("v"), time.Hour))
		got, ok, err := s.Take(ctx, "k")
		require.NoError(t, err, "take %d", i)
		require.True(t, ok, "take %d", i)
		assert.Equal(t, []byte("v"), got)
		_, ok, err = s.Take(ctx, "k")
		require.NoError(t, err)
		assert.False(t, ok)
	}
	assert.Equal(t, redisstore.Stats{Hits: 3, Misses: 3, Puts: 3}, s.Stats(), "the unknown GETDEL is no failure")
	msgs := logs.messages()
	require.Len(t, msgs, 1, "the switch is logged once")
	assert.Contains(t, msgs[0], "GETDEL")
	assert.NotContains(t, msgs[0], "bidikv:k", "keys are not logged")
}

func TestCanceledContext(t *testing.T) {
	srv := startServer(t)
	logs := &logRecorder{}
	s := newStore(t, srv, redisstore.WithLogger(slog.New(logs)))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()

	_, ok, err := s.Take(ctx, "k")
	assert.ErrorIs(t, err, context.Canceled)
	assert.False(t, ok)
	assert.ErrorIs(t, s.Put(ctx, "k", []byte("v"), time.Hour), context.Canceled)
	assert.Equal(t, redisstore.Stats{Canceled: 2}, s.Stats(), "a caller's cancel is not a Redis failure")
	assert.Empty(t, logs.messages())
}

func TestNewValidates(t *testing.T) {
	client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1"})
	t.Cleanup(func() { _ = client.Close() })
	tests := []struct {
		name string
		opts []redisstore.Option
		want string // in the error
	}{
		{"zero timeout", []redisstore.Option{redisstore.WithTimeout(0)}, "WithTimeout(0s)"},
		{"negative timeout", []redisstore.Option{redisstore.WithTimeout(-time.Second)}, "WithTimeout(-1s)"},
		{"zero max value", []redisstore.Option{redisstore.WithMaxValueBytes(0)}, "WithMaxValueBytes(0)"},
		{"negative recovery window", []redisstore.Option{redisstore.WithRecoveryWindow(-time.Second)}, "WithRecoveryWindow(-1s)"},
		{"negative wait replicas", []redisstore.Option{redisstore.WithWaitReplicas(-1)}, "WithWaitReplicas(-1)"},
		{"both", []redisstore.Option{redisstore.WithMaxValueBytes(-1), redisstore.WithTimeout(0)}, "WithMaxValueBytes(-1)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s, err := redisstore.New(client, tt.opts...)
			assert.ErrorIs(t, err, redisstore.ErrInvalidConfig)
			assert.ErrorContains(t, err, tt.want)
			assert.Nil(t, s)
			s, err = redisstore.NewFromURL("redis://127.0.0.1:1", tt.opts...)
			assert.ErrorIs(t, err, redisstore.ErrInvalidConfig)
			assert.Nil(t, s)
		})
	}

	t.Run("wait replicas on a ring", func(t *testing.T) {
		ring := redis.NewRing(&redis.RingOptions{Addrs: map[string]string{"a": "127.0.0.1:1"}})
		t.Cleanup(func() { _ = ring.Close() })
		_, err := redisstore.New(ring, redisstore.WithWaitReplicas(1))
		assert.ErrorIs(t, err, redisstore.ErrInvalidConfig)
		_, err = redisstore.New(ring)
		assert.NoError(t, err, "a ring without WithWaitReplicas")
	})
	t.Run("nil client", func(t *testing.T) {
		_, err := redisstore.New(nil)
		assert.ErrorIs(t, err, redisstore.ErrInvalidConfig)
	})
	t.Run("valid", func(t *testing.T) {
		srv := startServer(t)
		client := srv.client(t)
		s, err := redisstore.New(client, redisstore.WithTimeout(time.Second), redisstore.WithMaxValueBytes(1), redisstore.WithPrefix(""), redisstore.WithLogger(nil), redisstore.WithRecoveryWindow(0))
		require.NoError(t, err)
		assert.NoError(t, s.Close())
		assert.NoError(t, client.Ping(t.Context()).Err(), "Close must not close a caller's client")
	})
}

func TestNewFromURL(t *testing.T) {
	tests := []struct {
		url     string
		wantErr bool
	}{
		{"redis://127.0.0.1:6379/0", false},
		{"redis://:secret@127.0.0.1:6379/2", false},
		{"rediss://user:secret@[::1]:6380/0?dial_timeout=1s", false},
		{"http://127.0.0.1:6379", true},
		{"redis://:secret@127.0.0.1:notaport/0", true},
		{"redis://:secret@127.0.0.1:6379/notadb", true},
		{"redis://:secret@127.0.0.1:6379/0?pool_size=many", true},
		{"redis-sentinel://:secret@127.0.0.1:26379/0?master_name=m", false},
		{"rediss-sentinel://127.0.0.1:26379/0?master_name=m&addr=127.0.0.1:26380&password=secret", false},
		{"REDIS-SENTINEL://127.0.0.1:26379?master_name=m", false},
		{"redis-sentinel://:secret@127.0.0.1:26379/0", true},
		{"redis-sentinel://:secret@127.0.0.1:26379/0?master_name=m&addr=noport", true},
		{"redis-sentinel://:secret@127.0.0.1:26379,127.0.0.1:26380/0?master_name=m", true},
		{"redis-cluster://:secret@127.0.0.1:7000?addr=127.0.0.1:7001&addr=127.0.0.1:7002", false},
		{"rediss-cluster://user:secret@[::1]:7000/0?dial_timeout=1s", false},
		{"redis-cluster://:secret@127.0.0.1:7000/3", true},
		{"redis-cluster://:secret@127.0.0.1:7000?pool_size=many", true},
		{"redis-cluster://:secret@127.0.0.1:7000?db=1", true},
		{"redis-ring://:secret@127.0.0.1:7000", true},
	}
	for _, tt := range tests {
		t.Run(tt.url, func(t *testing.T) {
			s, err := redisstore.NewFromURL(tt.url)
			if !tt.wantErr {
				require.NoError(t, err)
				assert.NoError(t, s.Close())
				assert.NoError(t, s.Close(), "Close twice")
				return
			}
			assert.ErrorIs(t, err, redisstore.ErrInvalidConfig)
			assert.NotContains(t, err.Error(), "secret", "the error leaks the password")
		})
	}
}

func TestNewWarnsWithoutContextTimeouts(t *testing.T) {
	for _, tc := range []struct {
		name string
		on   bool
		want int // warnings
	}{{"off", false, 1}, {"on", true, 0}} {
		t.Run(tc.name, func(t *testing.T) {
			client := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: tc.on})
			t.Cleanup(func() { _ = client.Close() })
			logs := &logRecorder{}
			_, err := redisstore.New(client, redisstore.WithLogger(slog.New(logs)))
			require.NoError(t, err)
			assert.Len(t, logs.messages(), tc.want)
		})
	}
}
