package retention_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"strings"
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

// fakeClock is a settable clock for retention.SetClock.
type fakeClock struct{ t time.Time }

func (c *fakeClock) now() time.Time          { return c.t }
func (c *fakeClock) advance(d time.Duration) { c.t = c.t.Add(d) }
func newClocked(t *testing.T, opts ...retention.MemoryOption) (*retention.Memory, *fakeClock) {
	t.Helper()
	m, err := retention.NewMemory(opts...)
	require.NoError(t, err)
	c := &fakeClock{t: time.Unix(1_700_000_000, 0)}
	retention.SetClock(m, c.now)
	return m, c
}

func TestMemoryEvictsExpiredBeforeLive(t *testing.T) {
	m, clock := newClocked(t, retention.WithMaxEntries(2))
	require.NoError(t, m.Put(t.Context(), "old", []byte("old"), long))
	require.NoError(t, m.Put(t.Context(), "short", []byte("short"), 20*time.Millisecond))
	clock.advance(20 * time.Millisecond)

	// The Memory is full, one entry expired: the next Put drops it instead
	// of evicting "old", the least recently put.
	require.NoError(t, m.Put(t.Context(), "new", []byte("new"), long))
	st := m.Stats()
	assert.Equal(t, int64(1), st.Expired)
	assert.Zero(t, st.EvictedForEntries, "the expired entry made room")
	assert.Equal(t, []byte("old"), mustTake(t, m, "old"))
	assert.Equal(t, []byte("new"), mustTake(t, m, "new"))
	assertMiss(t, m, "short")
}

func TestMemoryExpiry(t *testing.T) {
	m, clock := newClocked(t)
	ctx := t.Context()
	// Mixed ttls, put out of expiry order: each expires at its own time.
	ttls := map[string]time.Duration{"a": 5 * time.Second, "b": time.Second, "c": 3 * time.Second, "d": 2 * time.Second, "e": 4 * time.Second}
	for _, k := range []string{"a", "b", "c", "d", "e"} {
		require.NoError(t, m.Put(ctx, k, []byte(k), ttls[k]))
	}
	require.NoError(t, m.Put(ctx, "c", []byte("c2"), 6*time.Second), "a Put replaces the ttl too")
	clock.advance(time.Second - 1)
	assert.Equal(t, 5, m.Len())
	clock.advance(1)
	assert.Equal(t, 4, m.Len(), "b expires at exactly its ttl")
	assert.Equal(t, 4, m.Stats().Entries, "Stats counts unexpired entries")
	assertMiss(t, m, "b")
	clock.advance(time.Second)
	assertMiss(t, m, "d")
	clock.advance(2 * time.Second)
	assertMiss(t, m, "e")
	assert.Equal(t, []byte("a"), mustTake(t, m, "a"), "a lives 5s")
	clock.advance(time.Second)
	assert.Equal(t, []byte("c2"), mustTake(t, m, "c"), "c's second ttl (6s) replaced its first (3s)")
	st := m.Stats()
	assert.Equal(t, int64(3), st.Expired)
	assert.Equal(t, int64(2), st.Hits)
	assert.Equal(t, int64(3), st.Misses)
	assert.Zero(t, m.Bytes())
	assert.Zero(t, st.Entries)
}

// TestMemoryAgainstModel runs random Puts, Takes and clock steps against a
// Memory and a plain map model of its documented behaviour: expiry at the
// ttl, eviction of the least recently put, byte and entry bounds.
func TestMemoryAgainstModel(t *testing.T) {
	type ent struct {
		v       string
		expires time.Time
		seq     int
	}
	const maxEntries, maxBytes = 16, 16 * (8 + 40 + retention.EntryOverhead)
	m, clock := newClocked(t, retention.WithMaxEntries(maxEntries), retention.WithMaxBytes(maxBytes))
	model := map[string]ent{}
	rng := rand.New(rand.NewPCG(1, 2))
	ctx := t.Context()
	seq := 0
	cost := func(k string, e ent) int64 { return int64(len(k) + len(e.v) + retention.EntryOverhead) }
	for step := range 20_000 {
		k := fmt.Sprintf("k%d", rng.IntN(40))
		switch op := rng.IntN(10); {
		case op < 5:
			v := strings.Repeat("v", rng.IntN(80))
			ttl := time.Duration(1+rng.IntN(50)) * time.Millisecond
			require.NoError(t, m.Put(ctx, k, []byte(v), ttl))
			now := clock.now()
			for mk, e := range model {
				if !now.Before(e.expires) {
					delete(model, mk)
				}
			}
			delete(model, k)
			total := func() (n int64) {
				for mk, e := range model {
					n += cost(mk, e)
				}
				return n
			}
			oldest := func() string {
				best, bs := "", -1
				for mk, e := range model {
					if bs < 0 || e.seq < bs {
						best, bs = mk, e.seq
					}
				}
				return best
			}
			seq++
			e := ent{v: v, expires: now.Add(ttl), seq: seq}
			if len(model) >= maxEntries {
				delete(model, oldest())
			}
			for total()+cost(k, e) > maxBytes {
				delete(model, oldest())
			}
			model[k] = e
		case op < 8:
			got, ok, err := m.Take(ctx, k)
			require.NoError(t, err)
			e, want := model[k]
			want = want && clock.now().Before(e.expires)
			require.Equal(t, want, ok, "step %d: Take(%s)", step, k)
			if ok {
				require.Equal(t, e.v, string(got), "step %d: Take(%s)", step, k)
			}
			delete(model, k)
		default:
			clock.advance(time.Duration(rng.IntN(10)) * time.Millisecond)
		}
		live := 0
		var bytes int64
		for mk, e := range model {
			if clock.now().Before(e.expires) {
				live++
			}
			bytes += cost(mk, e)
		}
		require.LessOrEqual(t, m.Bytes(), int64(maxBytes))
		require.LessOrEqual(t, m.Stats().Entries, maxEntries)
		if step%100 == 0 {
			require.Equal(t, live, m.Len(), "step %d", step)
		}
	}
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
		{"zero entries", retention.WithMaxEntries(0), "retention: WithMaxEntries(0): must be positive and at most 2147483647 (default 100000)"},
		{"negative entries", retention.WithMaxEntries(-1), "retention: WithMaxEntries(-1): must be positive and at most 2147483647 (default 100000)"},
		{"too many entries", retention.WithMaxEntries(1 << 31), "retention: WithMaxEntries(2147483648): must be positive and at most 2147483647 (default 100000)"},
		{"zero value size", retention.WithMaxValueSize(0), "retention: WithMaxValueSize(0): must be positive (default 8388608)"},
		{"zero bytes", retention.WithMaxBytes(0), "retention: WithMaxBytes(0): must be at least EntryOverhead, 96 (default 1073741824)"},
		{"negative bytes", retention.WithMaxBytes(-1), "retention: WithMaxBytes(-1): must be at least EntryOverhead, 96 (default 1073741824)"},
		{"bytes below the overhead", retention.WithMaxBytes(95), "retention: WithMaxBytes(95): must be at least EntryOverhead, 96 (default 1073741824)"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := retention.NewMemory(tt.opt)
			assert.Nil(t, m)
			assert.EqualError(t, err, tt.want)
		})
	}
}
