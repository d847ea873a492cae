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
	// DefaultMaxValueBytes bounds a stored value (8 MiB). A router's entry
	// is a small header, a decode engine's kv_transfer_params and a token
	// fingerprint: about 1.2 MB for a 1M-token context with two KV groups
	// at block size 16 (2 x 62,500 block ids plus a ~128 KB fingerprint),
	// so that fits with room to spare. Redis itself takes strings up to
	// 512 MB.
	DefaultMaxValueBytes = 8 << 20
	// DefaultTimeout bounds each Put and Take, including go-redis's own
	// retries. A Redis on the same network answers in well under a
	// millisecond; past this the turn is better off as a miss.
	DefaultTimeout = 50 * time.Millisecond
	// DefaultRecoveryWindow is how long calls must go without a failure
	// before an outage counts as over; see [WithRecoveryWindow].
	DefaultRecoveryWindow = 5 * time.Second
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
	recovery   time.Duration
	scriptTake bool
	replicas   int
	errs       []error
}

func defaultConfig() config {
	return config{
		prefix:   DefaultPrefix,
		maxValue: DefaultMaxValueBytes,
		timeout:  DefaultTimeout,
		recovery: DefaultRecoveryWindow,
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
// [DefaultMaxValueBytes], 8 MiB); a larger one fails with
// [ErrValueTooLarge] without reaching Redis. n must be at least 1: zero or
// a negative n is invalid. A value of several megabytes takes milliseconds
// to send over a network; raise [WithTimeout] if Puts of large handles time
// out.
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

// WithLogger sets where the Store reports outages: one warning, with the
// error, when a call fails while Redis was answering (an outage starts),
// and one info record when the outage ends (see [WithRecoveryWindow]),
// with the number of failed calls and the outage's duration. Failures in
// between are counted ([Stats]), not logged. A nil logger, the default,
// discards the records. Keys and values are never logged.
func WithLogger(l *slog.Logger) Option {
	return optionFunc(func(c *config) { c.logger = l })
}

// WithRecoveryWindow sets how long Redis must answer without a failed call
// before an outage counts as over (default [DefaultRecoveryWindow], 5 s).
// An outage starts at the first failed call and ends at the first call
// that succeeds at least d after the last failed one; calls that succeed
// sooner, as a flapping or half-broken Redis answers some calls (reads
// while writes fail on a full memory, say), do not end it. So the logger
// gets at most two records per d however Redis fails, and the record that
// ends an outage comes at least d after Redis recovered (its duration
// attribute runs to the first success after the last failure, not to the
// record). Zero ends an outage at the first successful call; negative is
// invalid.
func WithRecoveryWindow(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d < 0 {
			c.invalid("WithRecoveryWindow(%v): must be >= 0", d)
			return
		}
		c.recovery = d
	})
}

// WithScriptTake makes Take run a Lua script (GET then DEL, atomic on the
// server) instead of GETDEL. Without it, Take uses GETDEL and switches to
// the script by itself the first time the server answers that GETDEL is an
// unknown command, so this option is needed only where that answer differs
// (some proxies) or to skip the first failed attempt.
func WithScriptTake() Option {
	return optionFunc(func(c *config) { c.scriptTake = true })
}

// WithWaitReplicas makes Take hand out a value only once n replicas have
// acknowledged its deletion: Take sends GETDEL and then WAIT n on the same
// connection to the key's primary. If fewer than n replicas confirm within
// half of what is left of the call's timeout, Take returns an error
// matching [ErrNotReplicated] (counted in [Stats].Unreplicated) instead of
// the value; if the answer comes later than the timeout (Redis checks WAIT
// timeouts hz times a second, 10 by default), the call fails with the
// timeout. Either way the value is lost, a miss for the turn, never handed
// out twice.
//
// Without it (n = 0, the default) Redis's asynchronous replication leaves a
// window: a primary that fails after running a GETDEL and before sending it
// to its replicas can be replaced by a replica that still holds the value,
// and a later Take there gets it again. With n = 1 and one replica per
// primary, the replica that Sentinel or the cluster promotes has seen every
// delete whose value was handed out. With more replicas, a replica that
// has seen it exists, and both Sentinel and a cluster prefer the replica
// with the largest replication offset (which has seen every delete an
// acknowledged replica has), but only n equal to the number of replicas
// makes that certain.
//
// The cost is a round trip from the primary to a replica on every Take,
// and no hits at all while fewer than n replicas are in sync (after a
// failover, until the failed node is back as a replica, unless a primary
// has a replica to spare): prefer it when a decode engine reading the same
// blocks twice is worse than losing reuse for a while. In a cluster, Take
// goes straight to the primary the client's slot map names, without
// following redirections: a Take for a slot being migrated or just moved
// fails (a miss, and the map is reloaded for the next call). n must be at
// least 0, and n > 0 needs a *redis.Client (one Redis, or a Sentinel
// client) or a *redis.ClusterClient.
func WithWaitReplicas(n int) Option {
	return optionFunc(func(c *config) {
		if n < 0 {
			c.invalid("WithWaitReplicas(%d): must be >= 0", n)
			return
		}
		c.replicas = n
	})
}
