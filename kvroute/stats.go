package kvroute

import "sync/atomic"

// Stats are a Router's counters since New.
type Stats struct {
	// Stored counts handles retained for a next turn.
	Stored int64
	// NoStreamHandle counts streaming turns whose engine sent no handle
	// (stock vLLM without PR #40186).
	NoStreamHandle int64
	// NoPrefillHandle counts prefill answers without a usable handle.
	NoPrefillHandle int64
	// HitRetries counts prefill attempts with a handle that failed and
	// were retried as plain misses.
	HitRetries int64
	// StoreErrors counts Store failures; each turn went on as a miss.
	StoreErrors int64
	// Refusals counts finished turns whose handle the Identifier refused
	// to key.
	Refusals int64
	// Failures counts turns that ended with an error.
	Failures int64
}

type counters struct {
	stored, noStreamHandle, noPrefillHandle, hitRetries, storeErrors, refusals, failures atomic.Int64
}

func (c *counters) snapshot() Stats {
	return Stats{
		Stored:          c.stored.Load(),
		NoStreamHandle:  c.noStreamHandle.Load(),
		NoPrefillHandle: c.noPrefillHandle.Load(),
		HitRetries:      c.hitRetries.Load(),
		StoreErrors:     c.storeErrors.Load(),
		Refusals:        c.refusals.Load(),
		Failures:        c.failures.Load(),
	}
}
