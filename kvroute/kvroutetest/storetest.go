package kvroutetest

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
)

// TestStore checks that a [kvroute.Store] implementation keeps the Store
// contract, in the manner of testing/fstest.TestFS. Call it from a test:
//
//	func TestMyStore(t *testing.T) {
//		kvroutetest.TestStore(t, func(t *testing.T) kvroute.Store {
//			s := mystore.New(...)
//			t.Cleanup(func() { s.Close() })
//			return s
//		})
//	}
//
// newStore is called once per subtest and should register any cleanup with
// t.Cleanup. The stores it returns may share one backend (a Redis database,
// say): every key the suite uses starts with a prefix unique to the call, so
// runs never see each other's entries. The suite leaves no entry behind
// except short-lived ones.
//
// The subtests cover: a put/take round trip; Take removing the entry;
// missing keys; overwrite (the latest value and ttl win, one take); expiry;
// 32 KiB and binary values, and empty ones; the store copying the value on
// Put and the caller owning it after Take; cancelled and expired contexts;
// ttl <= 0 rejected; keys with odd bytes (separators, unicode, NUL, invalid
// UTF-8, 1 KiB); exactly one winner among 100 goroutines racing to Take one
// key; and concurrent puts and takes on many keys (up to 256 entries held at
// once: a bounded store must hold at least that many). Run it with -race.
//
// Expiry cannot use a virtual clock, so that subtest waits in real time: it
// stores entries with a 100 ms ttl and polls until one is gone (at most about
// 5 s), then checks that every other short-lived entry is gone too and that
// a long-lived one is still there. The whole suite takes well under a second
// against an in-memory store.
func TestStore(t *testing.T, newStore func(t *testing.T) kvroute.Store) {
	s := storeSuite{newStore: newStore, prefix: "kvroutetest:" + rand.Text() + ":"}
	t.Run("RoundTrip", s.roundTrip)
	t.Run("TakeRemoves", s.takeRemoves)
	t.Run("Missing", s.missing)
	t.Run("Overwrite", s.overwrite)
	t.Run("Expiry", s.expiry)
	t.Run("LargeValue", s.largeValue)
	t.Run("BinaryValue", s.binaryValue)
	t.Run("EmptyValue", s.emptyValue)
	t.Run("PutCopiesValue", s.putCopiesValue)
	t.Run("TakerOwnsValue", s.takerOwnsValue)
	t.Run("CancelledContext", s.cancelledContext)
	t.Run("InvalidTTL", s.invalidTTL)
	t.Run("OddKeys", s.oddKeys)
	t.Run("ConcurrentTake", s.concurrentTake)
	t.Run("ConcurrentKeys", s.concurrentKeys)
	t.Run("ConcurrentOverwrite", s.concurrentOverwrite)
}

// storeSuite holds what every subtest of TestStore needs.
type storeSuite struct {
	newStore func(t *testing.T) kvroute.Store
	prefix   string
}

// storeLongTTL outlives any subtest, so entries stored with it are present
// until taken.
const storeLongTTL = time.Hour

// key returns a key unique to this run and subtest.
func (s storeSuite) key(t *testing.T, name string) string {
	return s.prefix + t.Name() + ":" + name
}

func (s storeSuite) put(t *testing.T, st kvroute.Store, key string, value []byte, ttl time.Duration) {
	t.Helper()
	require.NoError(t, st.Put(t.Context(), key, value, ttl), "Put(%q)", key)
}

// mustTake requires that key holds want and takes it.
func (s storeSuite) mustTake(t *testing.T, st kvroute.Store, key string, want []byte) {
	t.Helper()
	got, ok, err := st.Take(t.Context(), key)
	require.NoError(t, err, "Take(%q)", key)
	require.True(t, ok, "Take(%q): missing, want a value", key)
	assert.Equal(t, want, got, "Take(%q)", key)
}

// mustMiss requires that key holds nothing.
func (s storeSuite) mustMiss(t *testing.T, st kvroute.Store, key string) {
	t.Helper()
	got, ok, err := st.Take(t.Context(), key)
	require.NoError(t, err, "Take(%q)", key)
	assert.False(t, ok, "Take(%q): got %q, want a miss", key, got)
	assert.Nil(t, got, "Take(%q) on a miss returned a value", key)
}

func (s storeSuite) roundTrip(t *testing.T) {
	st := s.newStore(t)
	key := s.key(t, "k")
	want := []byte(`{"remote_engine_id":"d-0","remote_block_ids":[[1,2,3]],"remote_num_tokens":1.0e3}`)
	s.put(t, st, key, want, storeLongTTL)
	s.mustTake(t, st, key, want)
}

func (s storeSuite) takeRemoves(t *testing.T) {
	st := s.newStore(t)
	key := s.key(t, "k")
	s.put(t, st, key, []byte("v"), storeLongTTL)
	s.mustTake(t, st, key, []byte("v"))
	s.mustMiss(t, st, key)
	s.mustMiss(t, st, key)
}

func (s storeSuite) missing(t *testing.T) {
	st := s.newStore(t)
	s.mustMiss(t, st, s.key(t, "never-stored"))
}

func (s storeSuite) overwrite(t *testing.T) {
	st := s.newStore(t)
	key := s.key(t, "k")
	s.put(t, st, key, []byte("first, and longer than the second"), storeLongTTL)
	s.put(t, st, key, []byte("second"), storeLongTTL)
	s.mustTake(t, st, key, []byte("second"))
	s.mustMiss(t, st, key)
}

func (s storeSuite) expiry(t *testing.T) {
	const (
		ttl    = 100 * time.Millisecond
		budget = 5 * time.Second
		n      = 40
	)
	st := s.newStore(t)
	keep := s.key(t, "keep")
	shortened := s.key(t, "shortened")
	s.put(t, st, keep, []byte("keep"), storeLongTTL)
	s.put(t, st, shortened, []byte("long"), storeLongTTL)
	s.put(t, st, shortened, []byte("short"), ttl)
	keys := make([]string, n)
	for i := range keys {
		keys[i] = s.key(t, fmt.Sprint(i))
		s.put(t, st, keys[i], []byte(keys[i]), ttl)
	}

	// Take one key per tick until one has expired. Polling with Take
	// consumes the entries that are still there, hence one key per poll.
	tick := time.NewTicker(budget / n)
	defer tick.Stop()
	missed := -1
	for i, key := range keys {
		got, ok, err := st.Take(t.Context(), key)
		require.NoError(t, err, "Take(%q)", key)
		if !ok {
			missed = i
			break
		}
		assert.Equal(t, []byte(key), got, "Take(%q) before expiry", key)
		<-tick.C
	}
	require.GreaterOrEqual(t, missed, 0, "no entry with a %v ttl expired within %v", ttl, budget)

	// Every short-lived entry was stored before the first miss, so all
	// have expired once another ttl (with a margin) has passed.
	time.Sleep(2 * ttl) // real time must pass: a store has no virtual clock
	for _, key := range keys[missed+1:] {
		s.mustMiss(t, st, key)
	}
	s.mustMiss(t, st, shortened) // the ttl of the latest Put wins
	s.mustTake(t, st, keep, []byte("keep"))
}

func (s storeSuite) largeValue(t *testing.T) {
	st := s.newStore(t)
	key := s.key(t, "k")
	want := make([]byte, 32<<10)
	_, _ = rand.Read(want)
	s.put(t, st, key, want, storeLongTTL)
	got, ok, err := st.Take(t.Context(), key)
	require.NoError(t, err)
	require.True(t, ok)
	assert.True(t, bytes.Equal(want, got), "32 KiB value changed in the store (got %d bytes)", len(got))
}

func (s storeSuite) binaryValue(t *testing.T) {
	st := s.newStore(t)
	key := s.key(t, "k")
	want := make([]byte, 0, 512)
	for i := range 256 {
		want = append(want, byte(i), byte(255-i))
	}
	s.put(t, st, key, want, storeLongTTL)
	s.mustTake(t, st, key, want)
}

func (s storeSuite) emptyValue(t *testing.T) {
	st := s.newStore(t)
	key := s.key(t, "k")
	s.put(t, st, key, []byte{}, storeLongTTL)
	got, ok, err := st.Take(t.Context(), key)
	require.NoError(t, err)
	assert.True(t, ok, "an empty value must be stored, not treated as a miss")
	assert.Empty(t, got)
	s.mustMiss(t, st, key)
}

func (s storeSuite) putCopiesValue(t *testing.T) {
	st := s.newStore(t)
	key := s.key(t, "k")
	buf := []byte("original")
	s.put(t, st, key, buf, storeLongTTL)
	copy(buf, "MUTATED!")
	s.mustTake(t, st, key, []byte("original"))
}

func (s storeSuite) takerOwnsValue(t *testing.T) {
	st := s.newStore(t)
	key := s.key(t, "k")
	s.put(t, st, key, []byte("first"), storeLongTTL)
	first, ok, err := st.Take(t.Context(), key)
	require.NoError(t, err)
	require.True(t, ok)

	s.put(t, st, key, []byte("again"), storeLongTTL)
	assert.Equal(t, []byte("first"), first, "a later Put changed a taken value")
	copy(first, "XXXXX")
	s.mustTake(t, st, key, []byte("again"))
}

func (s storeSuite) cancelledContext(t *testing.T) {
	cancelled, cancel := context.WithCancel(t.Context())
	cancel()
	expired, cancel2 := context.WithDeadline(t.Context(), time.Now().Add(-time.Second))
	defer cancel2()
	tests := []struct {
		name string
		ctx  context.Context
		want error
	}{
		{"Canceled", cancelled, context.Canceled},
		{"DeadlineExceeded", expired, context.DeadlineExceeded},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			st := s.newStore(t)
			stored := s.key(t, "stored")
			s.put(t, st, stored, []byte("v"), storeLongTTL)

			got, ok, err := st.Take(tt.ctx, stored)
			assert.ErrorIs(t, err, tt.want, "Take with a done context")
			assert.False(t, ok, "Take with a done context reported a value")
			assert.Nil(t, got, "Take with a done context returned a value")

			fresh := s.key(t, "fresh")
			err = st.Put(tt.ctx, fresh, []byte("v"), storeLongTTL)
			assert.ErrorIs(t, err, tt.want, "Put with a done context")

			// Whatever the store did, a value it still holds is intact.
			for _, key := range []string{stored, fresh} {
				got, ok, err := st.Take(t.Context(), key)
				require.NoError(t, err)
				if ok {
					assert.Equal(t, []byte("v"), got, "Take(%q)", key)
				}
			}
		})
	}
}

func (s storeSuite) invalidTTL(t *testing.T) {
	for _, ttl := range []time.Duration{0, -time.Nanosecond, -time.Minute} {
		t.Run(ttl.String(), func(t *testing.T) {
			st := s.newStore(t)
			key := s.key(t, "k")
			assert.Error(t, st.Put(t.Context(), key, []byte("v"), ttl), "Put with ttl %v", ttl)
			s.mustMiss(t, st, key)

			// A rejected Put leaves an earlier value alone.
			s.put(t, st, key, []byte("kept"), storeLongTTL)
			assert.Error(t, st.Put(t.Context(), key, []byte("v"), ttl), "Put with ttl %v", ttl)
			s.mustTake(t, st, key, []byte("kept"))
		})
	}
}

func (s storeSuite) oddKeys(t *testing.T) {
	st := s.newStore(t)
	suffixes := []string{
		"a",
		"a:b",
		"a:b:",
		"a:b:c",
		"A:B:C",
		"with space",
		"tab\tnew\nline\r",
		"ünïcødé 🔑 键",
		"nul\x00byte",
		"invalid utf-8 \xff\xfe",
		`glob*?[x] {braces} "quotes" \back`,
		strings.Repeat("k", 1024),
	}
	keys := make([]string, len(suffixes))
	for i, suffix := range suffixes {
		keys[i] = s.key(t, suffix)
		s.put(t, st, keys[i], fmt.Appendf(nil, "value %d", i), storeLongTTL)
	}
	for i, key := range keys {
		s.mustTake(t, st, key, fmt.Appendf(nil, "value %d", i))
	}
	for _, key := range keys {
		s.mustMiss(t, st, key)
	}
}

func (s storeSuite) concurrentTake(t *testing.T) {
	const (
		rounds = 10
		takers = 100
	)
	st := s.newStore(t)
	for round := range rounds {
		key := s.key(t, fmt.Sprint(round))
		want := fmt.Appendf(nil, "handle %d", round)
		s.put(t, st, key, want, storeLongTTL)

		type result struct {
			value []byte
			ok    bool
			err   error
		}
		results := make([]result, takers)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range results {
			wg.Go(func() {
				<-start
				v, ok, err := st.Take(t.Context(), key)
				results[i] = result{v, ok, err}
			})
		}
		close(start)
		wg.Wait()

		winners := 0
		for _, r := range results {
			require.NoError(t, r.err, "round %d", round)
			if r.ok {
				winners++
				assert.Equal(t, want, r.value, "round %d", round)
			}
		}
		require.Equal(t, 1, winners, "round %d: %d goroutines took the same handle", round, winners)
	}
}

func (s storeSuite) concurrentKeys(t *testing.T) {
	const (
		workers = 8
		perKey  = 32
	)
	st := s.newStore(t)
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			ctx := t.Context()
			keys := make([]string, perKey)
			for i := range keys {
				keys[i] = s.key(t, fmt.Sprintf("%d/%d", w, i))
				if !assert.NoError(t, st.Put(ctx, keys[i], []byte(keys[i]), storeLongTTL)) {
					return
				}
			}
			for _, key := range keys {
				got, ok, err := st.Take(ctx, key)
				if !assert.NoError(t, err) {
					return
				}
				assert.True(t, ok, "Take(%q): missing", key)
				assert.Equal(t, []byte(key), got, "Take(%q)", key)
			}
		})
	}
	wg.Wait()
}

func (s storeSuite) concurrentOverwrite(t *testing.T) {
	const writers = 32
	st := s.newStore(t)
	key := s.key(t, "k")
	valueOf := func(i int) []byte {
		return bytes.Repeat(fmt.Appendf(nil, "<writer %d>", i), 64)
	}
	var wg sync.WaitGroup
	for i := range writers {
		wg.Go(func() {
			assert.NoError(t, st.Put(t.Context(), key, valueOf(i), storeLongTTL))
		})
	}
	wg.Wait()

	got, ok, err := st.Take(t.Context(), key)
	require.NoError(t, err)
	require.True(t, ok)
	found := false
	for i := range writers {
		found = found || bytes.Equal(got, valueOf(i))
	}
	assert.True(t, found, "concurrent Puts left a value no writer stored: %.80q...", got)
	s.mustMiss(t, st, key)
}
