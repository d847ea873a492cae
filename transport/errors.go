package transport

import (
	"errors"
	"fmt"
	"time"
)

// Sentinel errors. Match them with errors.Is; the errors returned by this
// package wrap them with details.
var (
	// ErrFirstByteTimeout reports that no response headers arrived within
	// [Deadlines.FirstByte].
	ErrFirstByteTimeout = errors.New("transport: no response headers within the first-byte deadline")
	// ErrIdleTimeout reports that the response body yielded no data for
	// [Deadlines.Idle].
	ErrIdleTimeout = errors.New("transport: response body idle beyond the idle deadline")
	// ErrTotalTimeout reports that the whole exchange outlived
	// [Deadlines.Total].
	ErrTotalTimeout = errors.New("transport: exchange exceeded the total deadline")
	// ErrInvalidConfig reports an invalid option, deadline or retry policy.
	ErrInvalidConfig = errors.New("transport: invalid configuration")
	// ErrInvalidEndpoint reports a string that [ParseEndpoint] rejects.
	ErrInvalidEndpoint = errors.New("transport: invalid endpoint")
)

// timeoutError is the cancellation cause installed when one of our deadlines
// fires. It wraps one of the timeout sentinels and, like net.Error, reports
// Timeout() == true.
type timeoutError struct {
	kind  error
	limit time.Duration
}

func (e *timeoutError) Error() string { return fmt.Sprintf("%v (%v)", e.kind, e.limit) }
func (e *timeoutError) Unwrap() error { return e.kind }

// Timeout reports true, so that net.Error-style checks treat it as a timeout.
func (e *timeoutError) Timeout() bool { return true }
