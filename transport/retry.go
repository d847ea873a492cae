package transport

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Defaults used by [Retry] for zero fields of a [RetryPolicy].
const (
	// DefaultMaxAttempts is the number of calls, the first included.
	DefaultMaxAttempts = 3
	// DefaultInitialInterval is the backoff before the first retry.
	DefaultInitialInterval = 50 * time.Millisecond
	// DefaultMaxInterval caps the backoff before jitter.
	DefaultMaxInterval = time.Second
	// DefaultMultiplier grows the backoff after each retry.
	DefaultMultiplier = 2.0
	// DefaultRandomizationFactor spreads each backoff over ±50%.
	DefaultRandomizationFactor = 0.5
	// DefaultMaxRetryAfter is the longest Retry-After that is waited for.
	DefaultMaxRetryAfter = 5 * time.Second
)

// RetryPolicy configures [Retry]. The zero value is the default policy:
// 3 attempts, exponential backoff from 50ms doubling up to 1s with ±50%
// jitter, honouring Retry-After up to 5s.
type RetryPolicy struct {
	// MaxAttempts is the number of calls including the first (default
	// [DefaultMaxAttempts] when 0; 1 disables retries; negative is invalid).
	MaxAttempts int
	// InitialInterval is the backoff before the first retry (default
	// [DefaultInitialInterval] when 0; negative is invalid).
	InitialInterval time.Duration
	// MaxInterval caps the backoff before jitter (default
	// [DefaultMaxInterval] when 0; negative is invalid).
	MaxInterval time.Duration
	// Multiplier grows the backoff after each retry (default
	// [DefaultMultiplier] when 0; otherwise it must be >= 1).
	Multiplier float64
	// RandomizationFactor spreads each backoff uniformly over
	// [1-f, 1+f] times its value (default [DefaultRandomizationFactor] when
	// 0; negative means no jitter; above 1 is invalid).
	RandomizationFactor float64
	// MaxRetryAfter is the longest Retry-After that Retry waits for; a
	// longer one makes Retry give up at once and return the attempt's error
	// (default [DefaultMaxRetryAfter] when 0; negative is invalid).
	MaxRetryAfter time.Duration
	// NewTimer returns the timer for one Retry call's waits (default nil:
	// real time). Tests inject a virtual timer that fires at once and
	// records the durations. A fresh timer is requested per call, so the
	// policy may be shared by concurrent calls.
	NewTimer func() backoff.Timer
	// OnRetry, when not nil, is called after a failed attempt that will be
	// retried, with the attempt number (1 for the first call), its error and
	// the wait before the next attempt. Use it for metrics or logging; it
	// must not block.
	OnRetry func(attempt int, err error, wait time.Duration)
}

func (p RetryPolicy) withDefaults() (RetryPolicy, error) {
	var errs []error
	bad := func(format string, args ...any) {
		errs = append(errs, fmt.Errorf("%w: RetryPolicy."+format, append([]any{ErrInvalidConfig}, args...)...))
	}
	switch {
	case p.MaxAttempts < 0:
		bad("MaxAttempts %d: must be >= 0 (0 = default %d)", p.MaxAttempts, DefaultMaxAttempts)
	case p.MaxAttempts == 0:
		p.MaxAttempts = DefaultMaxAttempts
	}
	switch {
	case p.InitialInterval < 0:
		bad("InitialInterval %v: must be >= 0", p.InitialInterval)
	case p.InitialInterval == 0:
		p.InitialInterval = DefaultInitialInterval
	}
	switch {
	case p.MaxInterval < 0:
		bad("MaxInterval %v: must be >= 0", p.MaxInterval)
	case p.MaxInterval == 0:
		p.MaxInterval = DefaultMaxInterval
	}
	switch {
	case p.Multiplier == 0:
		p.Multiplier = DefaultMultiplier
	case !(p.Multiplier >= 1): // also rejects NaN
		bad("Multiplier %v: must be >= 1", p.Multiplier)
	}
	switch {
	case p.RandomizationFactor == 0:
		p.RandomizationFactor = DefaultRandomizationFactor
	case p.RandomizationFactor < 0:
		p.RandomizationFactor = 0
	case !(p.RandomizationFactor <= 1):
		bad("RandomizationFactor %v: must be <= 1 (negative = no jitter)", p.RandomizationFactor)
	}
	switch {
	case p.MaxRetryAfter < 0:
		bad("MaxRetryAfter %v: must be >= 0", p.MaxRetryAfter)
	case p.MaxRetryAfter == 0:
		p.MaxRetryAfter = DefaultMaxRetryAfter
	}
	return p, errors.Join(errs...)
}

// Permanent wraps err so that [Retry] returns it at once, unwrapped, without
// retrying. It is [backoff.Permanent]; nil stays nil.
func Permanent(err error) error { return backoff.Permanent(err) }

// Retry calls fn until it returns nil, at most p.MaxAttempts times, waiting
// between attempts with a fresh exponential backoff. attempt is 1 for the
// first call.
//
// fn returns the error of its attempt and, optionally, the server's
// Retry-After (see [RetryAfter]; 0 when absent). A Retry-After longer than
// the next backoff replaces it; one longer than p.MaxRetryAfter ends the
// retries. An error wrapped with [Permanent] (or backoff.Permanent) ends them
// too and is returned unwrapped; fn decides what is retryable, typically
// with [Retryable].
//
// Retry returns nil on success, the last attempt's error when it gives up,
// and ctx.Err() as soon as ctx is done, also while waiting; fn is not called
// when ctx is already done. An invalid p is an error wrapping
// [ErrInvalidConfig].
//
// Never resend a consumed KV handle: a retried prefill must not carry a
// decode handle that an earlier attempt may already have delivered.
func Retry(ctx context.Context, p RetryPolicy, fn func(attempt int) (retryAfter time.Duration, err error)) error {
	p, err := p.withDefaults()
	if err != nil {
		return err
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	// The first attempt runs before any backoff state is built: most
	// calls succeed at once and then allocate nothing here. A failure is
	// replayed as the backoff loop's first operation, so the loop (waits,
	// OnRetry, Stop, Permanent) runs exactly as if it had made the call.
	firstHint, firstErr := fn(1)
	if firstErr == nil {
		return nil
	}
	var perm *backoff.PermanentError
	if errors.As(firstErr, &perm) {
		return perm.Err
	}
	replay := true
	exp := backoff.NewExponentialBackOff(
		backoff.WithInitialInterval(p.InitialInterval),
		backoff.WithMaxInterval(p.MaxInterval),
		backoff.WithMultiplier(p.Multiplier),
		backoff.WithRandomizationFactor(p.RandomizationFactor),
		backoff.WithMaxElapsedTime(0),
	)
	hb := &hintedBackOff{exp: exp, maxHint: p.MaxRetryAfter}
	b := backoff.WithContext(backoff.WithMaxRetries(hb, uint64(p.MaxAttempts-1)), ctx)

	attempt := 1
	op := func() error {
		if replay {
			replay = false
			hb.hint = firstHint
			return firstErr
		}
		attempt++
		hint, err := fn(attempt)
		hb.hint = hint
		return err
	}
	var notify backoff.Notify
	if p.OnRetry != nil {
		notify = func(err error, wait time.Duration) { p.OnRetry(attempt, err, wait) }
	}
	var t backoff.Timer
	if p.NewTimer != nil {
		t = p.NewTimer()
	}
	return backoff.RetryNotifyWithTimer(op, b, notify, t)
}

// hintedBackOff is an exponential backoff that a server's Retry-After may
// lengthen, or end when the hint exceeds maxHint.
type hintedBackOff struct {
	exp     *backoff.ExponentialBackOff
	hint    time.Duration
	maxHint time.Duration
}

func (h *hintedBackOff) NextBackOff() time.Duration {
	next := h.exp.NextBackOff()
	if next == backoff.Stop {
		return backoff.Stop
	}
	if h.hint > h.maxHint {
		return backoff.Stop
	}
	return max(next, h.hint)
}

func (h *hintedBackOff) Reset() {
	h.exp.Reset()
	h.hint = 0
}
