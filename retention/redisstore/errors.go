package redisstore

import (
	"errors"

	"github.com/bidikv/bidikv/retention"
)

// Sentinel errors. Match them with errors.Is; the errors returned by this
// package wrap them with details.
var (
	// ErrInvalidConfig reports an invalid option or client given to [New]
	// or [NewFromURL].
	ErrInvalidConfig = errors.New("redisstore: invalid configuration")
	// ErrValueTooLarge reports a Put whose value exceeds the bound set by
	// [WithMaxValueBytes]. Nothing is sent to Redis. It wraps
	// retention.ErrTooLarge, which the router counts as a handle too large
	// to retain rather than as a store failure.
	ErrValueTooLarge error = valueTooLarge{}
	// ErrInvalidTTL reports a Put with a ttl <= 0, as the [kvroute.Store]
	// contract requires. Nothing is sent to Redis.
	ErrInvalidTTL = errors.New("redisstore: ttl must be positive")
	// ErrNotReplicated reports a Take that removed a value but did not
	// return it, because fewer replicas than [WithWaitReplicas] asked for
	// acknowledged the deletion in time. The value is lost, not kept.
	ErrNotReplicated = errors.New("redisstore: delete not acknowledged by enough replicas")
)

// valueTooLarge is ErrValueTooLarge: its own message, matching
// retention.ErrTooLarge too.
type valueTooLarge struct{}

func (valueTooLarge) Error() string { return "redisstore: value too large" }
func (valueTooLarge) Unwrap() error { return retention.ErrTooLarge }
