package redisstore_test

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/retention/redisstore"
)

// store is the part of kvroute.Store the benchmarks use.
type store interface {
	Put(ctx context.Context, key string, value []byte, ttl time.Duration) error
	Take(ctx context.Context, key string) ([]byte, bool, error)
}

// benchValue is the size of a typical entry: a small header plus a decode
// handle with a few hundred block ids.
var benchValue = make([]byte, 600)

// benchStores returns a Redis Store on a fresh server and a retention.Memory.
func benchStores(b *testing.B) map[string]store {
	srv := startServer(b)
	r := newStore(b, srv)
	m, err := retention.NewMemory()
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { _ = m.Close() })
	return map[string]store{"redis": r, "memory": m}
}

func benchKeys(n int) []string {
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("conversation-%08d", i)
	}
	return keys
}

func BenchmarkPut(b *testing.B) {
	stores := benchStores(b)
	keys := benchKeys(1024)
	for _, name := range []string{"redis", "memory"} {
		s := stores[name]
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			ctx := context.Background()
			i := 0
			for b.Loop() {
				if err := s.Put(ctx, keys[i%len(keys)], benchValue, 450*time.Second); err != nil {
					b.Fatal(err)
				}
				i++
			}
		})
	}
}

// BenchmarkTake measures hits: every Take finds a value that a Put, done
// while the timer was stopped, left there. Keys are refilled in batches that
// fit in a default retention.Memory.
func BenchmarkTake(b *testing.B) {
	const batch = 50_000
	stores := benchStores(b)
	keys := benchKeys(batch)
	for _, name := range []string{"redis", "memory"} {
		s := stores[name]
		b.Run(name, func(b *testing.B) {
			ctx := context.Background()
			b.ReportAllocs()
			putTake(b, ctx, s, keys)
		})
	}
}

func BenchmarkTakeMiss(b *testing.B) {
	stores := benchStores(b)
	for _, name := range []string{"redis", "memory"} {
		s := stores[name]
		b.Run(name, func(b *testing.B) {
			b.ReportAllocs()
			ctx := context.Background()
			for b.Loop() {
				if _, ok, err := s.Take(ctx, "never-stored"); err != nil || ok {
					b.Fatalf("Take = %v, %v", ok, err)
				}
			}
		})
	}
}

var latency = flag.Bool("redisstore.latency", false, "run TestLatency: p50/p99 of 10k puts and takes, Redis and memory")

// TestLatency reports latency percentiles of 10k sequential Puts and then
// 10k Takes (all hits) for a Redis Store and a retention.Memory. It asserts
// nothing about speed; run it with -redisstore.latency -v.
func TestLatency(t *testing.T) {
	if !*latency {
		t.Skip("run with -redisstore.latency -v")
	}
	const n = 10_000
	srv := startServer(t)
	r := newStore(t, srv, redisstore.WithTimeout(time.Second)) // report tails, do not cut them
	m, err := retention.NewMemory()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = m.Close() })
	keys := benchKeys(n)
	ctx := t.Context()
	for _, c := range []struct {
		name string
		s    store
	}{{"redis", r}, {"memory", m}} {
		puts := make([]time.Duration, n)
		for i, k := range keys {
			start := time.Now()
			require.NoError(t, c.s.Put(ctx, k, benchValue, 450*time.Second))
			puts[i] = time.Since(start)
		}
		takes := make([]time.Duration, n)
		for i, k := range keys {
			start := time.Now()
			_, ok, err := c.s.Take(ctx, k)
			takes[i] = time.Since(start)
			require.NoError(t, err)
			require.True(t, ok)
		}
		t.Logf("%-6s put  %s", c.name, percentiles(puts))
		t.Logf("%-6s take %s", c.name, percentiles(takes))
	}
	require.Zero(t, r.Stats().TakeErrors+r.Stats().PutErrors)
}

func percentiles(d []time.Duration) string {
	slices.Sort(d)
	at := func(p float64) time.Duration { return d[int(p*float64(len(d)-1))] }
	return fmt.Sprintf("p50 %-9v p99 %-9v p99.9 %-9v max %v", at(0.50), at(0.99), at(0.999), d[len(d)-1])
}

// BenchmarkTakeWait measures hits with WithWaitReplicas(1) on a primary
// with one replica, against GETDEL alone on the same primary: the
// difference is WAIT's round trip to the replica.
func BenchmarkTakeWait(b *testing.B) {
	const batch = 10_000
	ctx := context.Background()
	primary := startServer(b, "--repl-diskless-sync-delay", "0")
	replica := startServer(b, "--replicaof", "127.0.0.1", fmt.Sprint(primary.port))
	eventually(b, deployBudget, "replica in sync", func() error {
		repl, err := rawClient(b, replica.Addr()).Info(ctx, "replication").Result()
		if err == nil && !strings.Contains(repl, "master_link_status:up") {
			err = errors.New("not in sync")
		}
		return err
	})
	keys := benchKeys(batch)
	for _, tc := range []struct {
		name string
		opts []redisstore.Option
	}{{"getdel", nil}, {"wait1", []redisstore.Option{redisstore.WithWaitReplicas(1)}}} {
		s := newStore(b, primary, append([]redisstore.Option{redisstore.WithTimeout(time.Second)}, tc.opts...)...)
		b.Run(tc.name, func(b *testing.B) {
			b.ReportAllocs()
			putTake(b, ctx, s, keys)
		})
	}
}

// putTake times b.N takes of keys put beforehand in batches of len(keys)
// (the puts are not timed).
func putTake(b *testing.B, ctx context.Context, s store, keys []string) {
	b.Helper()
	for done := 0; done < b.N; {
		n := min(len(keys), b.N-done)
		b.StopTimer()
		for _, k := range keys[:n] {
			if err := s.Put(ctx, k, benchValue, 450*time.Second); err != nil {
				b.Fatal(err)
			}
		}
		b.StartTimer()
		for _, k := range keys[:n] {
			if _, ok, err := s.Take(ctx, k); err != nil || !ok {
				b.Fatalf("Take(%q) = %v, %v", k, ok, err)
			}
		}
		done += n
	}
}
