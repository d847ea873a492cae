package retention_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention"
)

const long = time.Hour

func mustTake(t *testing.T, m *retention.Memory, key string) []byte {
	t.Helper()
	v, ok, err := m.Take(t.Context(), key)
	require.NoError(t, err)
	require.True(t, ok, "Take(%q): missing", key)
	return v
}

func assertMiss(t *testing.T, m *retention.Memory, key string) {
	t.Helper()
	v, ok, err := m.Take(t.Context(), key)
	require.NoError(t, err)
	assert.False(t, ok, "Take(%q) = %q, want a miss", key, v)
}

func TestMemoryEvictsLeastRecentlyPut(t *testing.T) {
	m, err := retention.NewMemory(retention.WithMaxEntries(3))
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range []string{"a", "b", "c", "d"} {
		require.NoError(t, m.Put(t.Context(), k, []byte(k), long))
	}
	assert.Equal(t, 3, m.Len())
	// Overwriting b makes it the most recent, so c is now the oldest.
	require.NoError(t, m.Put(t.Context(), "b", []byte("b2"), long))
	require.NoError(t, m.Put(t.Context(), "e", []byte("e"), long))
	assert.Equal(t, 3, m.Len())

	assertMiss(t, m, "a")
	assertMiss(t, m, "c")
	assert.Equal(t, []byte("b2"), mustTake(t, m, "b"))
	assert.Equal(t, []byte("d"), mustTake(t, m, "d"))
	assert.Equal(t, []byte("e"), mustTake(t, m, "e"))
	assert.Equal(t, 0, m.Len())
	assert.Equal(t, int64(2), m.Stats().EvictedForEntries)
}

func TestMemoryEvictsExpiredBeforeLive(t *testing.T) {
	m, err := retention.NewMemory(retention.WithMaxEntries(2))
	if err != nil {
		t.Fatal(err)
	}
	require.NoError(t, m.Put(t.Context(), "old", []byte("old"), long))
	require.NoError(t, m.Put(t.Context(), "short", []byte("short"), 20*time.Millisecond))

	// Len counts unexpired entries without removing any; wait in real
	// time (ttlcache has no clock hook) until the short entry expires.
	deadline := time.Now().Add(5 * time.Second)
	for m.Len() != 1 {
		require.True(t, time.Now().Before(deadline), "entry with a 20ms ttl did not expire in 5s")
		time.Sleep(5 * time.Millisecond)
	}

	// The Memory is full (the expired entry still occupies a slot), yet the
	// next Put drops the expired entry instead of evicting "old", the least
	// recently put.
	require.NoError(t, m.Put(t.Context(), "new", []byte("new"), long))
	st := m.Stats()
	assert.Equal(t, int64(1), st.Expired)
	assert.Zero(t, st.EvictedForEntries, "the expired entry made room")
	assert.Equal(t, []byte("old"), mustTake(t, m, "old"))
	assert.Equal(t, []byte("new"), mustTake(t, m, "new"))
	assertMiss(t, m, "short")
}

func TestMemoryValueSize(t *testing.T) {
	tests := []struct {
		name  string
		opts  []retention.MemoryOption
		size  int
		isErr bool
	}{
		{"default limit", nil, retention.DefaultMaxValueSize, false},
		{"default limit plus one", nil, retention.DefaultMaxValueSize + 1, true},
		{"custom limit", []retention.MemoryOption{retention.WithMaxValueSize(10)}, 10, false},
		{"custom limit plus one", []retention.MemoryOption{retention.WithMaxValueSize(10)}, 11, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := retention.NewMemory(tt.opts...)
			if err != nil {
				t.Fatal(err)
			}
			err = m.Put(t.Context(), "k", make([]byte, tt.size), long)
			if !tt.isErr {
				require.NoError(t, err)
				assert.Len(t, mustTake(t, m, "k"), tt.size)
				return
			}
			require.ErrorIs(t, err, retention.ErrTooLarge)
			assert.Contains(t, err.Error(), fmt.Sprint(tt.size))
			assertMiss(t, m, "k")
		})
	}
}

func TestMemoryRejectsNonPositiveTTL(t *testing.T) {
	m, err := retention.NewMemory()
	if err != nil {
		t.Fatal(err)
	}
	for _, ttl := range []time.Duration{0, -1, -time.Hour} {
		err := m.Put(t.Context(), "k", []byte("v"), ttl)
		assert.ErrorIs(t, err, retention.ErrInvalidTTL, "ttl %v", ttl)
	}
	assert.Equal(t, 0, m.Len())
}

func TestMemoryContext(t *testing.T) {
	m, err := retention.NewMemory()
	if err != nil {
		t.Fatal(err)
	}
	require.NoError(t, m.Put(t.Context(), "k", []byte("v"), long))
	ctx, cancel := context.WithCancel(t.Context())
	cancel()

	_, ok, err := m.Take(ctx, "k")
	assert.ErrorIs(t, err, context.Canceled)
	assert.False(t, ok)
	assert.ErrorIs(t, m.Put(ctx, "k2", []byte("v"), long), context.Canceled)

	// A refused Take leaves the entry in place.
	assert.Equal(t, []byte("v"), mustTake(t, m, "k"))
	assertMiss(t, m, "k2")
}

func TestMemoryLen(t *testing.T) {
	m, err := retention.NewMemory()
	if err != nil {
		t.Fatal(err)
	}
	assert.Equal(t, 0, m.Len())
	for _, k := range []string{"a", "b", "c", "a"} {
		require.NoError(t, m.Put(t.Context(), k, []byte(k), long))
	}
	assert.Equal(t, 3, m.Len(), "overwriting a key adds no entry")
	mustTake(t, m, "b")
	assert.Equal(t, 2, m.Len())
	assertMiss(t, m, "b")
	assert.Equal(t, 2, m.Len())
}

func TestMemoryClose(t *testing.T) {
	m, err := retention.NewMemory()
	if err != nil {
		t.Fatal(err)
	}
	require.NoError(t, m.Put(t.Context(), "k", []byte("v"), long))
	require.NoError(t, m.Close())
	assert.Equal(t, 0, m.Len())

	_, ok, err := m.Take(t.Context(), "k")
	assert.ErrorIs(t, err, retention.ErrClosed)
	assert.False(t, ok)
	assert.ErrorIs(t, m.Put(t.Context(), "k", []byte("v"), long), retention.ErrClosed)
	assert.NoError(t, m.Close(), "Close is idempotent")
}

func TestNewMemoryPanicsOnInvalidOption(t *testing.T) {
	tests := []struct {
		name string
		opt  retention.MemoryOption
		want string
	}{
		{"zero entries", retention.WithMaxEntries(0), "retention: WithMaxEntries(0): must be positive (default 100000)"},
		{"negative entries", retention.WithMaxEntries(-1), "retention: WithMaxEntries(-1): must be positive (default 100000)"},
		{"zero value size", retention.WithMaxValueSize(0), "retention: WithMaxValueSize(0): must be positive (default 8388608)"},
		{"zero bytes", retention.WithMaxBytes(0), "retention: WithMaxBytes(0): must be at least EntryOverhead, 256 (default 1073741824)"},
		{"negative bytes", retention.WithMaxBytes(-1), "retention: WithMaxBytes(-1): must be at least EntryOverhead, 256 (default 1073741824)"},
		{"bytes below the overhead", retention.WithMaxBytes(255), "retention: WithMaxBytes(255): must be at least EntryOverhead, 256 (default 1073741824)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := retention.NewMemory(tt.opt)
			assert.Nil(t, m)
			assert.EqualError(t, err, tt.want)
		})
	}
}
