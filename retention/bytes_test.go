package retention_test

import (
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention"
)

// cost is what an entry under key with a value of n bytes counts against
// the byte bound.
func cost(key string, n int) int64 { return int64(len(key) + n + retention.EntryOverhead) }

func TestMemoryMaxBytesEvictsLeastRecentlyPut(t *testing.T) {
	const size = 4096 // a size class: the allocation is exactly this
	per := cost("a", size)
	m, err := retention.NewMemory(retention.WithMaxBytes(3 * per))
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "c"} {
		require.NoError(t, m.Put(t.Context(), k, make([]byte, size), long))
	}
	st := m.Stats()
	assert.Equal(t, 3*per, m.Bytes())
	assert.Zero(t, st.EvictedForBytes)

	// Overwriting a makes it the most recent, so b is now the oldest.
	require.NoError(t, m.Put(t.Context(), "a", make([]byte, size), long))
	require.NoError(t, m.Put(t.Context(), "d", make([]byte, size), long))
	st = m.Stats()
	assert.Equal(t, 3*per, m.Bytes())
	assert.Equal(t, int64(1), st.EvictedForBytes)
	assert.Zero(t, st.EvictedForEntries)

	// A value twice the size makes room by evicting the two oldest.
	require.NoError(t, m.Put(t.Context(), "e", make([]byte, 2*size), long))
	st = m.Stats()
	assert.Equal(t, int64(3), st.EvictedForBytes)
	assert.Equal(t, per+cost("e", 2*size), m.Bytes())
	assert.LessOrEqual(t, m.Bytes(), st.MaxBytes)

	assertMiss(t, m, "b")
	assertMiss(t, m, "c")
	assertMiss(t, m, "a")
	assert.Len(t, mustTake(t, m, "d"), size)
	assert.Len(t, mustTake(t, m, "e"), 2*size)
	assert.Zero(t, m.Bytes(), "taken entries no longer count")
	assert.Zero(t, m.Stats().Entries)
}

func TestMemoryEntryOverByteBound(t *testing.T) {
	const size = 4096
	bound := cost("k", size)
	m, err := retention.NewMemory(retention.WithMaxBytes(bound))
	if err != nil {
		t.Fatal(err)
	}
	require.NoError(t, m.Put(t.Context(), "k", make([]byte, size), long), "an entry exactly at the bound fits")
	require.NoError(t, m.Put(t.Context(), "k", []byte("kept"), long))

	err = m.Put(t.Context(), "k", make([]byte, size+1), long)
	require.ErrorIs(t, err, retention.ErrTooLarge)
	assert.Contains(t, err.Error(), "WithMaxBytes")
	err = m.Put(t.Context(), "kk", make([]byte, size), long)
	require.ErrorIs(t, err, retention.ErrTooLarge, "the key counts too")

	st := m.Stats()
	assert.Equal(t, int64(2), st.TooLarge)
	assert.Zero(t, st.EvictedForBytes, "a refused Put evicts nothing")
	assert.Equal(t, []byte("kept"), mustTake(t, m, "k"), "a refused Put leaves the earlier value")
}

func TestMemoryDefaultsFitLongContextHandles(t *testing.T) {
	// 1M tokens at block size 16 with two KV groups: 2 x 62,500 block ids
	// of about 8 bytes each in JSON, plus a ~128 KB token fingerprint.
	handle := make([]byte, 2*62_500*8+128<<10)
	m, err := retention.NewMemory()
	if err != nil {
		t.Fatal(err)
	}
	require.NoError(t, m.Put(t.Context(), "conv", handle, long))
	assert.Len(t, mustTake(t, m, "conv"), len(handle))
	st := m.Stats()
	assert.Equal(t, int64(retention.DefaultMaxBytes), st.MaxBytes)
	assert.Equal(t, retention.DefaultMaxValueSize, st.MaxValueSize)
	assert.Equal(t, retention.DefaultMaxEntries, st.MaxEntries)
}

func TestMemoryStatsCounts(t *testing.T) {
	m, err := retention.NewMemory(retention.WithMaxEntries(2), retention.WithMaxValueSize(8))
	if err != nil {
		t.Fatal(err)
	}
	ctx := t.Context()
	for _, k := range []string{"a", "b", "c"} {
		require.NoError(t, m.Put(ctx, k, []byte(k), long))
	}
	require.ErrorIs(t, m.Put(ctx, "d", make([]byte, 9), long), retention.ErrTooLarge)
	mustTake(t, m, "c")
	assertMiss(t, m, "a")
	st := m.Stats()
	assert.Equal(t, retention.MemoryStats{
		Entries: 1, MaxEntries: 2, MaxBytes: retention.DefaultMaxBytes, MaxValueSize: 8,
		Puts: 3, Hits: 1, Misses: 1, TooLarge: 1, EvictedForEntries: 1,
	}, st)
	assert.Equal(t, int64(1+1+retention.EntryOverhead), m.Bytes(), `"b"`)
}

// TestMemoryBurstStaysWithinBytes puts far more large values than the byte
// bound holds, from several goroutines, and checks the bound with the
// store's own accounting after every Put and, coarsely, with the heap.
func TestMemoryBurstStaysWithinBytes(t *testing.T) {
	const (
		bound   = 32 << 20
		size    = 1 << 20 // 1 MiB: a size class, so a value allocates exactly this
		workers = 4
		perW    = 64 // 256 MiB put in all, 8x the bound
	)
	value := make([]byte, size)
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)

	m, err := retention.NewMemory(retention.WithMaxBytes(bound))
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			for i := range perW {
				key := fmt.Sprintf("conv:%d:%d:%s", w, i, strings.Repeat("x", 40))
				if !assert.NoError(t, m.Put(t.Context(), key, value, long)) {
					return
				}
				if n := m.Bytes(); n > bound {
					t.Errorf("after a Put: %d bytes held, bound %d", n, bound)
					return
				}
			}
		})
	}
	wg.Wait()

	runtime.GC()
	runtime.ReadMemStats(&after)
	st := m.Stats()
	counted := m.Bytes()
	held := int64(after.HeapAlloc) - int64(before.HeapAlloc)
	t.Logf("%d entries, %d bytes counted, %d evicted for bytes; heap grew by %d bytes (bound %d)",
		st.Entries, counted, st.EvictedForBytes, held, bound)
	assert.LessOrEqual(t, counted, int64(bound))
	assert.Equal(t, int64(workers*perW), st.Puts)
	assert.Equal(t, int64(workers*perW-st.Entries), st.EvictedForBytes)
	assert.Equal(t, int(bound/cost("conv:0:0:"+strings.Repeat("x", 40), size)), st.Entries, "the bound is full")
	// The heap holds the entries and little else: allow 10% and 1 MiB of
	// slack for the test's own allocations.
	assert.Less(t, held, int64(bound)*11/10+1<<20, "heap grew by more than the byte bound")
	runtime.KeepAlive(m)
	runtime.KeepAlive(value)
}
