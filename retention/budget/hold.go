package budget

import (
	"fmt"
	"math"
	"time"
)

// Hold is a decode engine's KV kept for a retained handle, as the router
// stored it: until the conversation's next turn attaches it, it is
// released, or it expires.
type Hold struct {
	// Key is the handle's store key.
	Key string
	// Engine is the decode engine that holds the blocks (its URL).
	Engine string
	// Tokens is the handle's remote_num_tokens; the hold pins
	// ceil(Tokens/block size) blocks. At most 2^32-1.
	Tokens int
	// Created is when the turn ended and the hold began.
	Created time.Time
	// Expires is when the hold ends: Created plus the engine's TTL (vLLM's
	// decoder_kv_blocks_ttl, 480 s), or the caller's shorter retention,
	// with [WithGrace] for the rest of the engine's TTL.
	Expires time.Time
	// Features predict whether and when the conversation comes back.
	Features Features
	// Saved is the prefill time a hit on this hold would save, from the
	// caller's cost model (recomputing the tokens minus pulling them).
	// Zero means nothing: such a hold is released first.
	Saved time.Duration
	// Prefix, when the caller knows the hold's tokens, names its full
	// blocks (nil when it does not: every block of the hold is counted as
	// its own). Holds on one engine whose first blocks match share them,
	// counted once, as the engine's prefix cache stores them once, and
	// releasing one frees only the blocks no other hold references; the
	// last, partial block is always the hold's own (the engine caches
	// full blocks only). The ledger reads a block per [PrefixGranule]
	// tokens for the first [PrefixDense] of them, then 16 per doubling of
	// the prefix, at the same positions for every hold: holds share the
	// blocks up to the last position they have in common, and their
	// blocks in common after it are counted for each, as are a hold's
	// blocks after its last position. The ledger's blocks are never fewer
	// than the engine's distinct blocks, and more by less than a granule
	// per hold after the first where the holds part within the first
	// PrefixDense granules, by less than 1/16 of the prefix they share
	// beyond. Prefix is read during [Budget.Add] only, never kept; the
	// ledger keeps a node per position read of the holds' distinct
	// prefixes, and probes them at Add and at the hold's end.
	Prefix Blocks
	// PrefixBlockSize is the tokens per block of Prefix's blocks: when it
	// is not the engine's block size at Add, Prefix is not used (counted
	// in [Stats.PrefixIgnored]).
	PrefixBlockSize int
	// Owner is who the hold is for (the router's principal of the turn
	// that made it), an opaque string kept as a 64-bit hash:
	// [Budget.VictimsFor] limits what one owner releases of the others'
	// holds. Empty is an owner too.
	Owner string
}

// Blocks names a hold's full blocks, first to last, as the engine's
// prefix cache does ([Hold.Prefix]).
type Blocks interface {
	// Len is how many blocks are named: blocks past the hold's full
	// blocks are not read, and blocks past Len are counted as its own.
	Len() int
	// At returns block i's identity (0 ≤ i < Len()): a hash of its tokens
	// and of every token before it in the hold, so that two holds' block
	// i are equal only when their first i+1 blocks are (vLLM's
	// hash_block_tokens chains its block hashes the same way), and of
	// anything else the engine mixes into its prefix cache's block hash
	// (LoRA, cache salt).
	At(i int) uint64
}

// validate reports what is wrong with h.
func (h Hold) validate() error {
	switch {
	case h.Key == "":
		return fmt.Errorf("%w: empty Key", ErrInvalidHold)
	case h.Engine == "":
		return fmt.Errorf("%w: empty Engine", ErrInvalidHold)
	case h.Tokens <= 0 || h.Tokens > math.MaxUint32:
		return fmt.Errorf("%w: Tokens %d: must be in [1, 2^32-1]", ErrInvalidHold, h.Tokens)
	case !h.Expires.After(h.Created):
		return fmt.Errorf("%w: Expires %v is not after Created %v", ErrInvalidHold, h.Expires, h.Created)
	case h.Saved < 0:
		return fmt.Errorf("%w: negative Saved %v", ErrInvalidHold, h.Saved)
	}
	return nil
}

// Held is a live hold as the ledger records it.
type Held struct {
	// Key is the handle's store key.
	Key string
	// Engine is the decode engine that holds the blocks.
	Engine string
	// Tokens and Blocks are what the hold pins.
	Tokens, Blocks int
	// Shared is how many of Blocks other live holds on the engine also
	// reference ([Hold.Prefix]): releasing the hold frees Blocks − Shared.
	Shared int
	// Created and Expires are the hold's.
	Created, Expires time.Time
}

// Victim is a hold [Budget.Victims] chose to release.
type Victim struct {
	// Held is the hold: take its Key from the store, then release the
	// blocks the handle names.
	Held
	// Probability is the chance, when it was chosen, that its
	// conversation's next turn would have come before it expired.
	Probability float64
	// Value is the saved prefill seconds × Probability / Blocks at the
	// choice (or WithValue's): the holds of least value go first.
	Value float64
	// Other is true for a hold [Budget.VictimsFor] chose of an owner
	// other than the one it made room for.
	Other bool
}
