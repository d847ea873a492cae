package kvroute

import (
	"context"

	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
)

// The release phase. A vLLM decode engine frees a hold early only when a
// prefill request carrying its handle is scheduled: P then tells D to free
// the blocks, whether it pulls them or not. A handle the turn took and
// does not attach is therefore released through the turn's own prefill
// leg, at no extra request: its first attempt carries the handle with
// remote_num_tokens 0 (kvhandle.Release) instead of the miss handle, so
// that P counts nothing to pull, takes the notify-only path and computes
// the prompt as on a miss (its answer is a miss's), while D frees the
// hold at that moment instead of at its TTL.
//
// The rule: the turn releases the handle it took when it replaces it.
// That is when the turn goes through a prefill leg (it will retain D's
// new handle for the conversation: under the same key with a
// conversation id, under a longer one, which the conversation's next
// turn looks up first, by content) and the handle was not attached for
// what it holds, which no later turn of the conversation changes: too
// few verified tokens (MissThreshold; an edited or compacted history), no
// common prefix (MissMismatch), a partial read the handle's blocks do not
// allow (MissPartialRefused), or the cost model's choice to recompute
// (MissCostModel). A handle found past the retention TTL (MissExpired)
// while its decode engine still holds it (the decoder TTL has not run
// out) is released the same way: it can never be attached.
//
// Not released, put back as before: the handle of a decode-local turn
// (it stores no new handle: the old one stays the candidate and stays
// held), one that could not be verified (MissUnverified: it may be
// later), and any whose decode engine is not listed, is ejected, or whose
// capacity is unknown (the management then keeps today's behaviour).
// Handles of a restarted decode engine are dropped, not released
// (pointless: the blocks are gone; Stats.ReleaseSkipped). A retry of the
// prefill leg is a plain miss: the release handle goes to one attempt,
// and a failed one is counted (Stats.ReleaseFailures) and lapses at the
// TTL. The leg's answer never depends on it: P computes its prompt as a
// miss would; a 500 of a failed notification is retried as a plain miss
// and not counted against the engine, as for a hit.

// release decides what becomes of a handle the turn took and does not
// attach (w attaches none): it returns the handle rewritten to release
// the decode engine's hold, which the first prefill attempt carries, and
// why; or it puts the handle back (a decode-local turn's among them: it
// stays the candidate) and returns nil.
func release(ctx context.Context, t *turn, f *found, w way) ([]byte, releaseReason) {
	h, why, back := releaseOf(t, f, w)
	if back {
		f.putBack(ctx, t)
	}
	return h, why
}

// releaseOf is release's decision: the release handle and why, or
// whether the handle goes back to the Store (back).
func releaseOf(t *turn, f *found, w way) (h []byte, why releaseReason, back bool) {
	switch {
	case w.h.handle != nil:
		return nil, 0, false // attached
	case w.local != nil:
		return nil, 0, f.key != "" // decode-local: it stays the candidate
	}
	r := t.r
	switch {
	case f.key != "":
		why = releaseSuperseded
		if !supersedes(w.miss) || !r.mem.managed(f.e.Endpoint) || r.decode.eligible(f.e.Endpoint) == nil {
			return nil, 0, true
		}
	case f.expired:
		// Dropped as before unless it may still be held and releasing it
		// cannot fail the leg for what the router knows of the engine.
		why = releaseUnusable
		if f.age >= r.cfg.decoderTTL || !r.mem.managed(f.e.Endpoint) || r.decode.eligible(f.e.Endpoint) == nil {
			return nil, 0, false
		}
		if r.restarts.restartedSince(&f.e) {
			r.stats.releaseSkipped.Add(1)
			return nil, 0, false
		}
	default:
		return nil, 0, false
	}
	h, err := kvhandle.ReleaseKnown(f.e.Handle, 0, f.e.Blocks) // reads nothing: no block-count check
	if err != nil {
		return nil, 0, f.key != ""
	}
	return h, why, false
}

// supersedes reports whether a handle not attached for reason is dead
// once the turn retains its own (the release rule above).
func supersedes(reason MissReason) bool {
	switch reason {
	case MissThreshold, MissMismatch, MissPartialRefused, MissCostModel:
		return true
	}
	return false
}
