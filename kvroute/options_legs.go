package kvroute

import (
	"time"

	"github.com/bidikv/bidikv/transport"
)

// TTLs are how long the KV the legs leave behind lives: what the router
// keeps, and what it must know of the engines' own lifetimes.
type TTLs struct {
	// Retention is how long a decode handle is kept, counted from the
	// moment the router saw the decode engine finish: by default 450 s,
	// 30 s under the engines' default decoder_kv_blocks_ttl, as vLLM's
	// reference proxy does. It must leave at least expiryGuard under
	// DecoderBlocks.
	Retention time.Duration
	// DecoderBlocks is the decode engines' decoder_kv_blocks_ttl (vLLM's
	// default, 480 s), used only to validate Retention.
	DecoderBlocks time.Duration
	// PrefillLease is the prefill engines' kv_lease_duration (vLLM's
	// default, 30 s): a decode leg is sent with P's handle only while at
	// least expiryGuard of the lease is left; later, the turn is redone as
	// a plain miss. It must be longer than expiryGuard.
	PrefillLease time.Duration
}

// WithTTLs sets the TTLs. A zero field keeps its default (Defaults); a
// negative one is an error.
func WithTTLs(t TTLs) Option {
	return optionFunc(func(c *config) { c.ttls = t })
}

func resolveTTLs(c *config) {
	d, t := Defaults().TTLs, c.ttls
	c.positive("WithTTLs", "Retention", int64(t.Retention))
	c.positive("WithTTLs", "DecoderBlocks", int64(t.DecoderBlocks))
	c.positive("WithTTLs", "PrefillLease", int64(t.PrefillLease))
	c.retentionTTL = orDefault(t.Retention, d.Retention)
	c.decoderTTL = orDefault(t.DecoderBlocks, d.DecoderBlocks)
	c.lease = orDefault(t.PrefillLease, d.PrefillLease)
	if c.retentionTTL > 0 && c.decoderTTL > 0 && c.retentionTTL > c.decoderTTL-expiryGuard {
		c.fail("WithTTLs", "Retention %v leaves less than %v under the engines' decoder_kv_blocks_ttl of %v; use at most %v (or raise DecoderBlocks to match the engines)",
			c.retentionTTL, expiryGuard, c.decoderTTL, c.decoderTTL-expiryGuard)
	}
	if c.lease > 0 && c.lease <= expiryGuard {
		c.fail("WithTTLs", "PrefillLease %v must be longer than %v", c.lease, expiryGuard)
	}
}

// Timeouts bound the legs. They are per phase, never a client-wide
// timeout, which would cut long streams.
type Timeouts struct {
	// Prefill bounds the prefill leg, from sending the request to reading
	// P's whole answer (default 60 s).
	Prefill time.Duration
	// FirstByte bounds the wait for the decode engine's response headers
	// (default 60 s).
	FirstByte time.Duration
	// Idle bounds the gap between two stream reads from the decode engine
	// (default 120 s).
	Idle time.Duration
	// Render bounds one render call (token verification, and the prompt
	// fingerprint of Responses and Messages turns; default 10 s): a call
	// that runs out opens that engine's render breaker, and turns go on
	// without a render.
	Render time.Duration
	// Buffered bounds the wait for the answer of a buffered stream's
	// decode leg (WithDecodeMemory's BufferStreams), which runs
	// non-streaming: the engine sends its headers with the whole answer,
	// so this bounds the whole decode, in place of FirstByte (default 10
	// min, the Anthropic SDKs' own request timeout).
	Buffered time.Duration
}

// WithTimeouts sets the legs' timeouts. A zero field keeps its default
// (Defaults); a negative Prefill, FirstByte, Idle or Buffered means no
// limit; Render must be limited (negative is an error).
func WithTimeouts(t Timeouts) Option {
	return optionFunc(func(c *config) { c.timeouts = t })
}

func resolveTimeouts(c *config) {
	d, t := Defaults().Timeouts, c.timeouts
	c.prefillTimeout = orNone(t.Prefill, d.Prefill)
	c.firstByteTimeout = orNone(t.FirstByte, d.FirstByte)
	c.idleTimeout = orNone(t.Idle, d.Idle)
	c.bufferedTimeout = orNone(t.Buffered, d.Buffered)
	c.positive("WithTimeouts", "Render", int64(t.Render))
	c.renderTimeout = orDefault(t.Render, d.Render)
}

// Failover says what a turn does when a leg fails.
type Failover struct {
	// PrefillRetry is how failed prefill legs are retried (attempts,
	// backoff, the longest Retry-After honoured). Its zero value is
	// transport.RetryPolicy's defaults: 3 attempts, backoff from 50 ms
	// doubling to 1 s, Retry-After honoured up to 5 s. MaxAttempts 1
	// disables retries.
	PrefillRetry transport.RetryPolicy
	// DecodeAttempts bounds how many decode legs one turn may start,
	// retries included (default 3; 1 disables decode retries). After a
	// leg that timed out, at most one more leg follows, to another
	// healthy engine. docs/kvroute.md, Failure paths, says when a decode
	// leg is retried.
	DecodeAttempts int
	// LocalPrefill chooses what happens when the prefill engine answers
	// without a handle. False (the default), the turn fails with 502. True,
	// the decode engine gets the client's request with no
	// kv_transfer_params and prefills locally; the fallback is logged and
	// reported to the Observer. The miss handle is never sent to a decode
	// engine either way.
	LocalPrefill bool
}

// WithFailover sets what a turn does when a leg fails. A zero field keeps
// its default (Defaults); a negative DecodeAttempts is an error.
func WithFailover(f Failover) Option {
	return optionFunc(func(c *config) { c.failover = f })
}

func resolveFailover(c *config) {
	f := c.failover
	c.positive("WithFailover", "DecodeAttempts", int64(f.DecodeAttempts))
	c.retry = f.PrefillRetry
	c.decodeAttempts = orDefault(f.DecodeAttempts, Defaults().Failover.DecodeAttempts)
	c.localFallback = f.LocalPrefill
}

// orDefault is v, or def for a zero v.
func orDefault[T int | int64 | time.Duration](v, def T) T {
	if v == 0 {
		return def
	}
	return v
}

// orNone is a duration that may be unlimited: v, def for a zero v, and 0
// (no limit) for a negative one.
func orNone(v, def time.Duration) time.Duration {
	switch {
	case v < 0:
		return 0
	case v == 0:
		return def
	}
	return v
}
