package retention

import (
	"errors"
	"fmt"
)

const (
	// DefaultMaxEntries is the default bound on the number of entries a
	// Memory holds.
	DefaultMaxEntries = 100_000
	// DefaultMaxValueSize is the default bound, in bytes, on one value
	// stored in a Memory (8 MiB). A handle for a 1M-token context with two
	// KV groups at block size 16 (2 x 62,500 block ids, about 1 MB of JSON)
	// plus its token fingerprint (about 128 KB) fits with room to spare.
	DefaultMaxValueSize = 8 << 20
	// DefaultMaxBytes is the default bound, in bytes, on what a Memory
	// holds in all (1 GiB), counted as described at [WithMaxBytes].
	DefaultMaxBytes = 1 << 30
	// EntryOverhead is the fixed number of bytes a Memory counts for each
	// entry on top of its key and value: its bookkeeping (an array slot,
	// an expiry heap slot and a map slot, about 80 bytes) and the
	// allocator's rounding of the key and value up to a size class.
	EntryOverhead = 96
	// MaxEntriesLimit is the largest entry bound [WithMaxEntries] accepts.
	MaxEntriesLimit = 1<<31 - 1
)

// MemoryOption configures a [Memory] built by [NewMemory].
type MemoryOption interface {
	apply(*memoryConfig)
}

type memoryConfig struct {
	maxEntries   int
	maxValueSize int
	maxBytes     int64
}

func defaultMemoryConfig() memoryConfig {
	return memoryConfig{
		maxEntries:   DefaultMaxEntries,
		maxValueSize: DefaultMaxValueSize,
		maxBytes:     DefaultMaxBytes,
	}
}

// validate checks the configuration once every option is applied and
// returns every problem, each wrapping ErrInvalidConfig and naming the
// option and the fix (nil when there is none).
func (c memoryConfig) validate() error {
	var errs []error
	fail := func(format string, args ...any) {
		errs = append(errs, &configError{msg: "retention: " + fmt.Sprintf(format, args...)})
	}
	if c.maxEntries <= 0 || c.maxEntries > MaxEntriesLimit {
		fail("WithMaxEntries(%d): must be positive and at most %d (default %d)", c.maxEntries, MaxEntriesLimit, DefaultMaxEntries)
	}
	if c.maxValueSize <= 0 {
		fail("WithMaxValueSize(%d): must be positive (default %d)", c.maxValueSize, DefaultMaxValueSize)
	}
	if c.maxBytes < EntryOverhead {
		fail("WithMaxBytes(%d): must be at least EntryOverhead, %d (default %d)", c.maxBytes, EntryOverhead, DefaultMaxBytes)
	}
	return errors.Join(errs...)
}

// configError is an invalid option: its message names the option and the
// fix, and it wraps ErrInvalidConfig.
type configError struct{ msg string }

func (e *configError) Error() string { return e.msg }
func (e *configError) Unwrap() error { return ErrInvalidConfig }

type memoryOptionFunc func(*memoryConfig)

func (f memoryOptionFunc) apply(c *memoryConfig) { f(c) }

// WithMaxEntries bounds the number of entries. When a Put of a new key finds
// the Memory full, it first drops expired entries and then, if still full,
// evicts the least recently put entry (counted in
// [MemoryStats.EvictedForEntries]). The default is [DefaultMaxEntries]; n
// must be positive and at most [MaxEntriesLimit] (NewMemory fails
// otherwise).
func WithMaxEntries(n int) MemoryOption {
	return memoryOptionFunc(func(c *memoryConfig) { c.maxEntries = n })
}

// WithMaxValueSize bounds the size of one value in bytes; Put of a larger
// value fails with an error wrapping [ErrTooLarge]. The default is
// [DefaultMaxValueSize] (8 MiB); n must be positive (NewMemory fails on
// zero or a negative n). A value must also fit the byte bound of
// [WithMaxBytes] on its own.
func WithMaxValueSize(n int) MemoryOption {
	return memoryOptionFunc(func(c *memoryConfig) { c.maxValueSize = n })
}

// WithMaxBytes bounds the bytes a Memory holds in all. Each entry counts
// its key's length, its value's length and [EntryOverhead]. A Put that would take
// the total over n first drops expired entries and then evicts least
// recently put entries until the new one fits (counted in
// [MemoryStats.EvictedForBytes]); a single entry larger than n fails with
// an error wrapping [ErrTooLarge] and evicts nothing. The default is
// [DefaultMaxBytes] (1 GiB); n must be at least [EntryOverhead] (NewMemory
// fails on zero, a negative or a smaller n).
//
// The bound covers what the Memory holds, not values already taken: a
// value returned by Take belongs to the caller and no longer counts.
func WithMaxBytes(n int64) MemoryOption {
	return memoryOptionFunc(func(c *memoryConfig) { c.maxBytes = n })
}
