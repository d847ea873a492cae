package retention

import "errors"

var (
	// ErrTooLarge is wrapped by Put when the value exceeds the store's
	// value size limit.
	ErrTooLarge = errors.New("retention: value too large")
	// ErrInvalidTTL is wrapped by Put when the ttl is zero or negative.
	ErrInvalidTTL = errors.New("retention: ttl must be positive")
	// ErrInvalidConfig is wrapped by every error NewMemory returns for a
	// bad option.
	ErrInvalidConfig = errors.New("retention: invalid configuration")
	// ErrClosed is returned by Put and Take after Close.
	ErrClosed = errors.New("retention: store closed")
)
