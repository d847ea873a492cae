package retention

import "fmt"

const (
	// DefaultMaxEntries is the default bound on the number of entries a
	// Memory holds.
	DefaultMaxEntries = 100_000
	// DefaultMaxValueSize is the default bound, in bytes, on one value
	// stored in a Memory (64 KiB).
	DefaultMaxValueSize = 64 << 10
)

// MemoryOption configures a [Memory] built by [NewMemory].
type MemoryOption interface {
	apply(*memoryConfig)
}

type memoryConfig struct {
	maxEntries   int
	maxValueSize int
}

func defaultMemoryConfig() memoryConfig {
	return memoryConfig{
		maxEntries:   DefaultMaxEntries,
		maxValueSize: DefaultMaxValueSize,
	}
}

// validate reports the first out-of-range option, naming it and the fix.
func (c memoryConfig) validate() error {
	if c.maxEntries <= 0 {
		return fmt.Errorf("retention: WithMaxEntries(%d): must be positive (default %d)", c.maxEntries, DefaultMaxEntries)
	}
	if c.maxValueSize <= 0 {
		return fmt.Errorf("retention: WithMaxValueSize(%d): must be positive (default %d)", c.maxValueSize, DefaultMaxValueSize)
	}
	return nil
}

type memoryOptionFunc func(*memoryConfig)

func (f memoryOptionFunc) apply(c *memoryConfig) { f(c) }

// WithMaxEntries bounds the number of entries. When a Put of a new key finds
// the Memory full, it first drops expired entries and then, if still full,
// evicts the least recently put entry. The default is [DefaultMaxEntries];
// n must be positive (NewMemory panics otherwise).
func WithMaxEntries(n int) MemoryOption {
	return memoryOptionFunc(func(c *memoryConfig) { c.maxEntries = n })
}

// WithMaxValueSize bounds the size of one value in bytes; Put of a larger
// value fails with an error wrapping [ErrTooLarge]. The default is
// [DefaultMaxValueSize]; n must be positive (NewMemory panics otherwise).
func WithMaxValueSize(n int) MemoryOption {
	return memoryOptionFunc(func(c *memoryConfig) { c.maxValueSize = n })
}
