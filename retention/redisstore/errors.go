package redisstore

import "errors"

// Sentinel errors. Match them with errors.Is; the errors returned by this
// package wrap them with details.
var (
	// ErrInvalidConfig reports an invalid option or client given to [New]
	// or [NewFromURL].
	ErrInvalidConfig = errors.New("redisstore: invalid configuration")
	// ErrValueTooLarge reports a Put whose value exceeds the bound set by
	// [WithMaxValueBytes]. Nothing is sent to Redis.
	ErrValueTooLarge = errors.New("redisstore: value too large")
	// ErrInvalidTTL reports a Put with a ttl <= 0, as the [kvroute.Store]
	// contract requires. Nothing is sent to Redis.
	ErrInvalidTTL = errors.New("redisstore: ttl must be positive")
)
