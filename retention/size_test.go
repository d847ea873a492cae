package retention_test

import (
	"context"
	"fmt"
	"runtime"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"

	"github.com/bidikv/bidikv/retention"
)

// retainedPerEntry returns the heap bytes a Memory retains per entry after
// n Puts of valueSize-byte values under keyLen-byte keys.
func retainedPerEntry(n, keyLen, valueSize int) float64 {
	keys := make([]string, n)
	for i := range keys {
		k := fmt.Sprintf("conv:%036d", i)
		for len(k) < keyLen {
			k += "x"
		}
		keys[i] = k[:keyLen]
	}
	value := make([]byte, valueSize)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	m, err := retention.NewMemory(retention.WithMaxEntries(n))
	if err != nil {
		panic(err)
	}
	ctx := context.Background()
	for _, k := range keys {
		if err := m.Put(ctx, k, value, time.Hour); err != nil {
			panic(err)
		}
	}
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(m)
	runtime.KeepAlive(keys)
	return float64(after.HeapAlloc-before.HeapAlloc) / float64(n)
}

func TestMemoryRetainedBytes(t *testing.T) {
	// The target from the design: a 600-byte handle under a 41-byte key
	// costs at most twice its payload, bookkeeping included.
	const keyLen, valueSize = 41, 600
	for _, n := range []int{1_000, 20_000} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			per := retainedPerEntry(n, keyLen, valueSize)
			t.Logf("%d entries: %.0f bytes retained per entry, %.2fx the payload", n, per, per/(keyLen+valueSize))
			assert.Less(t, per, 2.0*(keyLen+valueSize))
			assert.Greater(t, per, float64(valueSize), "the measurement missed the values")
		})
	}
}
