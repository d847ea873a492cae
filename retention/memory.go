package retention

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"time"

	"github.com/jellydator/ttlcache/v3"
)

// Memory is an in-process store of decode handles, bounded in entries and in
// value size. It implements kvroute.Store and is safe for concurrent use.
//
// Put copies the value, so the caller may reuse its buffer; Take removes the
// entry and hands the stored slice to the caller, who then owns it. Take is
// atomic: of any number of concurrent callers for one key, exactly one gets
// the value.
//
// A Memory holds at most its [WithMaxEntries] bound: when full, a Put of a
// new key evicts the least recently put entry, after dropping expired ones.
//
// Expired entries are never returned. They are dropped by the next Put (the
// check is one comparison when nothing has expired), so a Memory starts no
// goroutine. Expiry follows the real clock: the underlying ttlcache reads
// time.Now and offers no clock hook, so tests of expiry must wait in real
// time.
//
// Each entry costs about 240 bytes of bookkeeping (cache item, LRU list
// element, expiry heap slot and map slot) plus its key and value, each
// rounded up to the Go allocator's size class. Measured: a 600-byte value
// under a 41-byte key retains about 925 bytes (1.45x the payload), so a
// Memory full at [DefaultMaxEntries] with such values holds about 90 MiB.
type Memory struct {
	cache        *ttlcache.Cache[string, []byte]
	maxValueSize int
	closed       atomic.Bool
}

// NewMemory returns an empty Memory configured by opts. It panics if an
// option is out of range (see [WithMaxEntries] and [WithMaxValueSize]); the
// panic message names the option.
func NewMemory(opts ...MemoryOption) *Memory {
	cfg := defaultMemoryConfig()
	for _, o := range opts {
		o.apply(&cfg)
	}
	if err := cfg.validate(); err != nil {
		panic(err.Error())
	}
	return &Memory{
		cache: ttlcache.New(
			ttlcache.WithCapacity[string, []byte](uint64(cfg.maxEntries)),
			ttlcache.WithDisableTouchOnHit[string, []byte](),
		),
		maxValueSize: cfg.maxValueSize,
	}
}

// Put stores a copy of value under key for ttl, replacing any earlier value
// and its ttl. It returns ctx.Err() if ctx is already done, an error
// wrapping [ErrInvalidTTL] if ttl <= 0, one wrapping [ErrTooLarge] if value
// exceeds the size limit, and [ErrClosed] after Close.
func (m *Memory) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if m.closed.Load() {
		return ErrClosed
	}
	if ttl <= 0 {
		return fmt.Errorf("%w: got %v", ErrInvalidTTL, ttl)
	}
	if len(value) > m.maxValueSize {
		return fmt.Errorf("%w: %d bytes, limit %d (WithMaxValueSize)", ErrTooLarge, len(value), m.maxValueSize)
	}
	v := make([]byte, len(value))
	copy(v, value)
	// Drop expired entries first so that a full cache evicts them rather
	// than a live one, and so that expired values do not linger.
	m.cache.DeleteExpired()
	// Clone the key: it may share memory with a much larger string.
	m.cache.Set(strings.Clone(key), v, ttl)
	return nil
}

// Take removes and returns the value stored under key; ok is false when
// there is none (never stored, expired, evicted or already taken). It
// returns ctx.Err() if ctx is already done and [ErrClosed] after Close.
func (m *Memory) Take(ctx context.Context, key string) (value []byte, ok bool, err error) {
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	if m.closed.Load() {
		return nil, false, ErrClosed
	}
	// GetAndDelete holds the cache's lock across the lookup and the
	// delete, so exactly one concurrent caller finds the entry.
	item, ok := m.cache.GetAndDelete(key)
	if !ok {
		return nil, false, nil
	}
	return item.Value(), true, nil
}

// Len returns the number of unexpired entries.
func (m *Memory) Len() int {
	return m.cache.Len()
}

// Close drops every entry; later calls to Put and Take return [ErrClosed].
// Close is idempotent and always returns nil. A Memory holds no goroutine
// or other resource, so Close only releases memory early.
func (m *Memory) Close() error {
	if !m.closed.Swap(true) {
		m.cache.DeleteAll()
	}
	return nil
}
