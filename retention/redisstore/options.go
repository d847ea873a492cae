package redisstore

import (
	"fmt"
	"log/slog"
	"time"
)

// Defaults users reason about. Every option documents its own default too.
const (
	// DefaultPrefix is put in front of every key, so that the handles share
	// a Redis database with other data without clashing.
	DefaultPrefix = "bidikv:"
	// DefaultMaxValueBytes bounds a stored value. A router's entry is a
	// small header plus a decode engine's kv_transfer_params, well under
	// this even for long block lists.
	DefaultMaxValueBytes = 64 << 10
	// DefaultTimeout bounds each Put and Take, including go-redis's own
	// retries. A Redis on the same network answers in well under a
	// millisecond; past this the turn is better off as a miss.
	DefaultTimeout = 50 * time.Millisecond
)

// An Option configures [New] and [NewFromURL]. Options are created by the
// With* functions.
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	prefix     string
	maxValue   int
	timeout    time.Duration
	logger     *slog.Logger
	scriptTake bool
	errs       []error
}

func defaultConfig() config {
	return config{
		prefix:   DefaultPrefix,
		maxValue: DefaultMaxValueBytes,
		timeout:  DefaultTimeout,
	}
}

func (c *config) invalid(format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...))
}

// WithPrefix sets the string put in front of every key (default
// [DefaultPrefix]). The empty string stores keys as they are. Replicas that
// share handles must use the same prefix; deployments that must not share
// them use different ones.
func WithPrefix(p string) Option {
	return optionFunc(func(c *config) { c.prefix = p })
}

// WithMaxValueBytes bounds the size of a value given to Put (default
// [DefaultMaxValueBytes]); a larger one fails with [ErrValueTooLarge]
// without reaching Redis. n must be at least 1.
func WithMaxValueBytes(n int) Option {
	return optionFunc(func(c *config) {
		if n < 1 {
			c.invalid("WithMaxValueBytes(%d): must be >= 1", n)
			return
		}
		c.maxValue = n
	})
}

// WithTimeout bounds each Put and Take (default [DefaultTimeout]); the
// caller's context still applies and may end the call sooner. Zero or
// negative is invalid: a call to Redis must never be able to hang a turn.
//
// The bound reaches the network only if the client honours context
// deadlines: [NewFromURL] sets ContextTimeoutEnabled; a client given to
// [New] should have it set too, or its ReadTimeout and WriteTimeout
// (default 3 s) bound a call to an unresponsive server instead.
func WithTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d <= 0 {
			c.invalid("WithTimeout(%v): must be > 0", d)
			return
		}
		c.timeout = d
	})
}

// WithLogger sets where the Store reports outages: one warning when a call
// fails after a success, one info record when a call succeeds after a
// failure, with the number of failed calls in between. A nil logger, the
// default, discards them. Keys and values are never logged.
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(c *config) { c.logger = l })
}

// WithScriptTake makes Take run a Lua script (GET then DEL, atomic on the
// server) instead of GETDEL. Without it, Take uses GETDEL and switches to
// the script by itself the first time the server answers that GETDEL is an
// unknown command, so this option is needed only where that answer differs
// (some proxies) or to skip the first failed attempt.
func WithScriptTake() Option {
	return optionFunc(func(c *config) { c.scriptTake = true })
}
