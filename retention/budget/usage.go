package budget

import (
	"slices"
	"time"
)

// ageBuckets are the upper bounds of the age histogram in [Usage]; the
// last count is of holds older than the last bound.
var ageBuckets = [...]time.Duration{15 * time.Second, 30 * time.Second, time.Minute, 2 * time.Minute, 4 * time.Minute, 8 * time.Minute}

// AgeBounds returns the upper bounds of [Usage.Ages]' buckets: 15 s, 30 s,
// 1, 2, 4 and 8 min (the last count is of older holds).
func AgeBounds() []time.Duration { return slices.Clone(ageBuckets[:]) }

// Usage is what one decode engine holds, and its budget.
type Usage struct {
	// Engine is the decode engine.
	Engine string
	// Holds, Tokens and Blocks are its live holds and what they pin:
	// Tokens summed over the holds, Blocks distinct (a block holds share
	// through [Hold.Prefix] once).
	Holds  int
	Tokens int64
	Blocks int64
	// HeldTokens is Blocks × the engine's block size: the memory counted
	// against the budget.
	HeldTokens int64
	// Capacity is its KV capacity in tokens (0: unknown), and Budget the
	// share of it holds may take (0: no budget).
	Capacity, Budget int64
	// Ages counts the holds by age, with the bounds of [AgeBounds] and one
	// more bucket for older ones.
	Ages [len(ageBuckets) + 1]int
}

// Usage reports every engine's holds at now, in the order engines were
// first seen.
func (b *Budget) Usage(now time.Time) []Usage {
	n := now.UnixNano()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(n)
	out := make([]Usage, 0, len(b.engines))
	for _, e := range b.engines {
		c := e.capacity
		if c == 0 {
			c = b.cfg.capacity
		}
		u := Usage{
			Engine: e.name, Holds: len(e.recs), Tokens: e.tokens, Blocks: e.blocks,
			HeldTokens: e.blocks * int64(b.blockSize(e)),
			Capacity:   c, Budget: b.budgetTokens(e),
		}
		for i := range e.recs {
			age := time.Duration(n - e.recs[i].created)
			k, _ := slices.BinarySearch(ageBuckets[:], age)
			u.Ages[k]++
		}
		out = append(out, u)
	}
	return out
}

// Held returns what engine's live holds pin, in tokens (whole blocks ×
// its block size: the memory counted against the budget), and its budget
// in tokens (0: no budget, its capacity unknown), as of now. It costs a
// map lookup (and the expiry of holds past their Expires), for a caller
// that asks on every turn; an engine never seen has neither.
func (b *Budget) Held(engine string, now time.Time) (held, budget int64) {
	n := now.UnixNano()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(n)
	i, ok := b.byName[engine]
	if !ok {
		return 0, 0
	}
	e := b.engines[i]
	return e.blocks * int64(b.blockSize(e)), b.budgetTokens(e)
}

// BlockSize returns engine's tokens per block as the ledger counts them
// (its [Budget.SetCapacity], else [WithBlockSize]): the block size a
// [Hold.Prefix] must be of.
func (b *Budget) BlockSize(engine string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if i, ok := b.byName[engine]; ok {
		return b.blockSize(b.engines[i])
	}
	return b.cfg.blockSize
}

// Capacity returns engine's KV capacity in tokens as the ledger knows it
// (its [Budget.SetCapacity], else [WithCapacity]; 0: unknown). It costs a
// map lookup, for a caller that asks on every turn.
func (b *Budget) Capacity(engine string) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	c := b.cfg.capacity
	if i, ok := b.byName[engine]; ok && b.engines[i].capacity > 0 {
		c = b.engines[i].capacity
	}
	return c
}
