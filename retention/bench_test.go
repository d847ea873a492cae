package retention_test

import (
	"context"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/bidikv/bidikv/retention"
)

func BenchmarkMemoryPut(b *testing.B) {
	m, err := retention.NewMemory()
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	value := make([]byte, 600)
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = "conv:" + strconv.Itoa(i)
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		if err := m.Put(ctx, keys[i%len(keys)], value, time.Hour); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkMemoryPutTake(b *testing.B) {
	m, err := retention.NewMemory()
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	value := make([]byte, 600)
	b.ReportAllocs()
	for b.Loop() {
		if err := m.Put(ctx, "conv:1", value, time.Hour); err != nil {
			b.Fatal(err)
		}
		if _, ok, err := m.Take(ctx, "conv:1"); !ok || err != nil {
			b.Fatal(ok, err)
		}
	}
}

func BenchmarkMemoryPutTakeParallel(b *testing.B) {
	m, err := retention.NewMemory()
	if err != nil {
		b.Fatal(err)
	}
	ctx := context.Background()
	value := make([]byte, 600)
	b.ReportAllocs()
	var id atomic.Int64
	b.RunParallel(func(pb *testing.PB) {
		key := "conv:" + strconv.FormatInt(id.Add(1), 10)
		for pb.Next() {
			if err := m.Put(ctx, key, value, time.Hour); err != nil {
				b.Error(err)
				return
			}
			if _, ok, err := m.Take(ctx, key); !ok || err != nil {
				b.Error(ok, err)
				return
			}
		}
	})
}

// BenchmarkMemoryRetained reports the heap retained per entry for a
// 600-byte value under a 41-byte key (ns/op is meaningless here).
func BenchmarkMemoryRetained(b *testing.B) {
	var per float64
	for b.Loop() {
		per = retainedPerEntry(50_000, 41, 600)
	}
	b.ReportMetric(per, "B/entry")
	b.ReportMetric(per/(600+41), "x-payload")
}
