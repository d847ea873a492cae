package retention

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Memory is an in-process store of decode handles, bounded in entries, in
// bytes and in value size. It implements kvroute.Store and is safe for
// concurrent use.
//
// Put copies the key and the value; Take removes the entry and returns a
// fresh copy of the value, which the caller owns. Take is atomic: of any
// number of concurrent callers for one key, exactly one gets the value.
//
// A Memory holds at most its [WithMaxEntries] bound of entries and its
// [WithMaxBytes] bound of bytes: a Put that would exceed either first drops
// expired entries and then evicts least recently put entries until the new
// one fits. [Memory.Stats] counts the evictions by bound; [Memory.Bytes]
// gives what the entries count against the byte bound.
//
// Expired entries are never returned. They are dropped by the next Put,
// Take, Len or Stats (the check is one comparison when nothing has
// expired), so a Memory starts no goroutine. Expiry follows the real clock.
//
// Each entry is one allocation holding its key and value, plus about 80
// bytes of bookkeeping (a slot in an array, a place in the expiry heap and
// a map slot); the byte bound counts [EntryOverhead] for the bookkeeping.
// Measured: a 600-byte value under a 41-byte key retains about 780 bytes
// (1.2x the payload), so a Memory full at [DefaultMaxEntries] with such
// values holds about 75 MiB, well under [DefaultMaxBytes]; with 1 MB
// handles the byte bound (1 GiB, about a thousand of them) applies first.
//
// Memory does not use ttlcache, the module's general TTL cache: a handle
// of a short conversation is 300 to 400 bytes of JSON, and ttlcache's
// bookkeeping per entry (an item with its own lock, an LRU list element,
// an expiry heap slot and a map slot: about 215 bytes) would hold more
// than twice the handle. Memory needs less: its LRU order is the put order
// (a hit removes the entry, so nothing is ever touched), kept as links
// between array slots.
type Memory struct {
	maxEntries   int
	maxValueSize int
	maxBytes     int64
	now          func() time.Time
	closed       atomic.Bool

	mu             sync.Mutex
	index          map[string]int32 // key -> slot; the key shares the slot's data
	slots          []slot
	free           int32   // first free slot, linked through next; nilSlot if none
	oldest, newest int32   // put order, linked through prev/next
	heap           []int32 // slots by expiry, a binary min-heap
	bytes          int64   // what the entries count against maxBytes

	puts, hits, misses, tooLarge   atomic.Int64
	expired, evictEntries, evictBy atomic.Int64
}

const nilSlot = -1

// slot is one entry: its key and value in one string, when it expires,
// its neighbours in put order and its place in the expiry heap.
type slot struct {
	data       string // key then value
	klen       int32
	at         int32 // index in heap
	expires    int64 // UnixNano
	prev, next int32
}

func (s *slot) key() string   { return s.data[:s.klen] }
func (s *slot) value() string { return s.data[s.klen:] }

// MemoryStats describes a [Memory]: its bounds, what it holds, and counts
// since it was created.
type MemoryStats struct {
	// Entries is the number of unexpired entries held now.
	Entries int
	// MaxEntries is the entry bound ([WithMaxEntries]).
	MaxEntries int
	// MaxBytes is the byte bound ([WithMaxBytes]).
	MaxBytes int64
	// MaxValueSize is the value size bound ([WithMaxValueSize]).
	MaxValueSize int
	// Puts counts values stored.
	Puts int64
	// Hits counts Takes that returned a value.
	Hits int64
	// Misses counts Takes that found none.
	Misses int64
	// TooLarge counts Puts refused with [ErrTooLarge].
	TooLarge int64
	// Expired counts expired entries dropped.
	Expired int64
	// EvictedForEntries counts unexpired entries evicted to stay within
	// the entry bound.
	EvictedForEntries int64
	// EvictedForBytes counts unexpired entries evicted to stay within the
	// byte bound.
	EvictedForBytes int64
}

// NewMemory returns an empty Memory configured by opts. It applies every
// option, then validates them once: an error wraps [ErrInvalidConfig] and
// names each option out of range (see [WithMaxEntries],
// [WithMaxValueSize] and [WithMaxBytes]).
func NewMemory(opts ...MemoryOption) (*Memory, error) {
	cfg := defaultMemoryConfig()
	for _, o := range opts {
		o.apply(&cfg)
	}
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	return &Memory{
		maxEntries:   cfg.maxEntries,
		maxValueSize: cfg.maxValueSize,
		maxBytes:     cfg.maxBytes,
		now:          time.Now,
		index:        map[string]int32{},
		free:         nilSlot,
		oldest:       nilSlot,
		newest:       nilSlot,
	}, nil
}

// entryCost is what an entry counts against the byte bound.
func entryCost(key, value int) int64 {
	return int64(key) + int64(value) + EntryOverhead
}

// Put stores a copy of value under key for ttl, replacing any earlier value
// and its ttl. It returns ctx.Err() if ctx is already done, an error
// wrapping [ErrInvalidTTL] if ttl <= 0, one wrapping [ErrTooLarge] if value
// exceeds the value size bound or the entry alone exceeds the byte bound
// (an earlier value under key is then left in place), and [ErrClosed] after
// Close.
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
		m.tooLarge.Add(1)
		return fmt.Errorf("%w: %d bytes, limit %d (WithMaxValueSize)", ErrTooLarge, len(value), m.maxValueSize)
	}
	cost := entryCost(len(key), len(value))
	if cost > m.maxBytes {
		m.tooLarge.Add(1)
		return fmt.Errorf("%w: entry of %d bytes (key, value and overhead), limit %d (WithMaxBytes)", ErrTooLarge, cost, m.maxBytes)
	}
	var b strings.Builder
	b.Grow(len(key) + len(value))
	b.WriteString(key)
	b.Write(value)
	data := b.String()

	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed.Load() {
		return ErrClosed
	}
	now := m.now().UnixNano()
	// Drop expired entries first so that a full Memory evicts them rather
	// than a live one, and so that expired values do not linger.
	m.dropExpired(now)
	if i, ok := m.index[key]; ok {
		m.remove(i)
	} else if len(m.index) >= m.maxEntries {
		m.remove(m.oldest)
		m.evictEntries.Add(1)
	}
	for m.bytes+cost > m.maxBytes {
		m.remove(m.oldest)
		m.evictBy.Add(1)
	}
	m.insert(data, len(key), now+int64(ttl), cost)
	m.puts.Add(1)
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
	m.mu.Lock()
	m.dropExpired(m.now().UnixNano())
	i, ok := m.index[key]
	var v string
	if ok {
		v = m.slots[i].value()
		m.remove(i)
	}
	m.mu.Unlock()
	if !ok {
		m.misses.Add(1)
		return nil, false, nil
	}
	m.hits.Add(1)
	return []byte(v), true, nil
}

// insert adds an entry; m.mu held, the key absent and the bounds checked.
func (m *Memory) insert(data string, klen int, expires, cost int64) {
	i := m.free
	if i == nilSlot {
		i = int32(len(m.slots))
		m.slots = append(m.slots, slot{})
	} else {
		m.free = m.slots[i].next
	}
	s := &m.slots[i]
	*s = slot{data: data, klen: int32(klen), expires: expires, prev: m.newest, next: nilSlot}
	if m.newest != nilSlot {
		m.slots[m.newest].next = i
	} else {
		m.oldest = i
	}
	m.newest = i
	s.at = int32(len(m.heap))
	m.heap = append(m.heap, i)
	m.up(int(s.at))
	m.index[s.key()] = i
	m.bytes += cost
}

// remove drops slot i; m.mu held.
func (m *Memory) remove(i int32) {
	s := &m.slots[i]
	delete(m.index, s.key())
	m.bytes -= entryCost(int(s.klen), len(s.data)-int(s.klen))
	if s.prev != nilSlot {
		m.slots[s.prev].next = s.next
	} else {
		m.oldest = s.next
	}
	if s.next != nilSlot {
		m.slots[s.next].prev = s.prev
	} else {
		m.newest = s.prev
	}
	at := int(s.at)
	last := len(m.heap) - 1
	if at != last {
		m.heap[at] = m.heap[last]
		m.slots[m.heap[at]].at = int32(at)
	}
	m.heap = m.heap[:last]
	if at != last {
		m.down(at)
		m.up(at)
	}
	*s = slot{next: m.free, prev: nilSlot, at: nilSlot}
	m.free = i
}

// dropExpired removes the entries expired at now; m.mu held.
func (m *Memory) dropExpired(now int64) {
	for len(m.heap) > 0 && m.slots[m.heap[0]].expires <= now {
		m.remove(m.heap[0])
		m.expired.Add(1)
	}
	if len(m.index) == 0 && cap(m.slots) > 1024 {
		// Empty after a burst: give the arrays back.
		m.slots, m.heap, m.free = nil, nil, nilSlot
	}
}

func (m *Memory) less(a, b int) bool {
	return m.slots[m.heap[a]].expires < m.slots[m.heap[b]].expires
}

func (m *Memory) swap(a, b int) {
	m.heap[a], m.heap[b] = m.heap[b], m.heap[a]
	m.slots[m.heap[a]].at = int32(a)
	m.slots[m.heap[b]].at = int32(b)
}

func (m *Memory) up(j int) {
	for j > 0 {
		p := (j - 1) / 2
		if !m.less(j, p) {
			return
		}
		m.swap(j, p)
		j = p
	}
}

func (m *Memory) down(j int) {
	n := len(m.heap)
	for {
		c := 2*j + 1
		if c >= n {
			return
		}
		if c+1 < n && m.less(c+1, c) {
			c++
		}
		if !m.less(c, j) {
			return
		}
		m.swap(j, c)
		j = c
	}
}

// Len returns the number of unexpired entries held; it drops the entries
// that have expired first.
func (m *Memory) Len() int {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.dropExpired(m.now().UnixNano())
	return len(m.index)
}

// Stats returns the Memory's bounds and counts. It takes the Memory's lock
// for a moment (to drop what has expired, as [Memory.Len]) and loads a few
// counters, so it may be called as often as metrics are scraped. The
// counts are read atomically one by one: together they are a near-instant
// snapshot, not a transaction.
func (m *Memory) Stats() MemoryStats {
	return MemoryStats{
		Entries:           m.Len(),
		MaxEntries:        m.maxEntries,
		MaxBytes:          m.maxBytes,
		MaxValueSize:      m.maxValueSize,
		Puts:              m.puts.Load(),
		Hits:              m.hits.Load(),
		Misses:            m.misses.Load(),
		TooLarge:          m.tooLarge.Load(),
		Expired:           m.expired.Load(),
		EvictedForEntries: m.evictEntries.Load(),
		EvictedForBytes:   m.evictBy.Load(),
	}
}

// Bytes returns what the entries held count against the byte bound
// ([WithMaxBytes]): for each, its key's and its value's lengths and
// [EntryOverhead]. It takes the Memory's lock for a moment.
func (m *Memory) Bytes() int64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.bytes
}

// Close drops every entry; later calls to Put and Take return [ErrClosed].
// Close is idempotent and always returns nil. A Memory holds no goroutine
// or other resource, so Close only releases memory early.
func (m *Memory) Close() error {
	if !m.closed.Swap(true) {
		m.mu.Lock()
		m.index = map[string]int32{}
		m.slots, m.heap = nil, nil
		m.free, m.oldest, m.newest = nilSlot, nilSlot, nilSlot
		m.bytes = 0
		m.mu.Unlock()
	}
	return nil
}
