package budget

import (
	"math"
	"time"
)

// cand is a hold considered by Victims.
type cand struct {
	value   float64
	prob    float64
	created int64
	slot    uint32
}

// before orders candidates: least value first, then the oldest.
func (c cand) before(d cand) bool {
	if c.value != d.value {
		return c.value < d.value
	}
	return c.created < d.created
}

// Victims returns the holds on engine to release so that its held memory
// plus incoming tokens fits in its budget (WithFraction × its capacity),
// least value first, and removes them from the ledger (they are watched
// for their conversation's next turn for the horizon, like an expired
// hold). A hold's value is the prefill time a hit would save × the
// chance that its conversation's next turn comes before the hold expires,
// given how long it has waited, per block held.
//
// It returns nothing while the engine fits its budget (with free memory,
// holding costs nothing), nor for an engine whose capacity is unknown.
// Memory is counted in whole blocks (a hold of n tokens takes
// ceil(n/block size) × block size tokens), a block holds share through
// their [Hold.Prefix] once; a hold's value is per block its release
// frees, and a hold whose every block other holds share (its release
// frees nothing) is not chosen. When even releasing every hold
// would not make room for incoming, it releases them all. Equal values go
// oldest first.
//
// The caller takes each victim's key from the store (a key already taken,
// by a turn or another replica, needs no release) and releases what it
// took. Victims costs a walk of the engine's holds when the engine is over
// its budget: the gap model's probability for each and a heap, about
// 20 µs for 1,000 holds and 0.35 ms for 10,000 (BenchmarkVictims); for
// a hold with a [Hold.Prefix] what its release frees is walked once, and
// again only after another hold came to share or stopped sharing its
// blocks (BenchmarkVictimsPrefix); an engine under its budget costs a
// comparison.
func (b *Budget) Victims(engine string, incoming int, now time.Time) []Victim {
	v, _ := b.victims(engine, incoming, 0, false, -1, now)
	return v
}

// VictimsFor is [Budget.Victims] for a caller that makes room for owner
// (a [Hold.Owner]): of the holds of other owners it chooses at most
// others tokens' worth (their Tokens; each marked Other), passing over
// any that would go beyond, while owner's own holds are chosen without
// limit. limited reports that a hold was passed over: the victims free
// less than Victims' would. A negative others is no limit (Victims).
func (b *Budget) VictimsFor(engine string, incoming int, owner string, others int64, now time.Time) (victims []Victim, limited bool) {
	return b.victims(engine, incoming, ownerHash(owner), true, others, now)
}

// victims is Victims, limited to others tokens of holds not of owner
// when byOwner and others >= 0.
func (b *Budget) victims(engine string, incoming int, owner uint64, byOwner bool, others int64, now time.Time) ([]Victim, bool) {
	n := now.UnixNano()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(n)
	ei, ok := b.byName[engine]
	if !ok {
		return nil, false
	}
	e := b.engines[ei]
	budget := b.budgetTokens(e)
	if budget <= 0 {
		return nil, false
	}
	bs := int64(b.blockSize(e))
	need := (e.blocks+(int64(max(incoming, 0))+bs-1)/bs)*bs - budget
	if need <= 0 {
		return nil, false
	}
	b.refresh(n, false)

	cands := b.cands[:0]
	tier := int(b.tier.Load())
	b.model.mu.Lock()
	for i := range e.recs {
		r := &e.recs[i]
		waited := float64(n-r.created) / 1e9
		p := b.model.probability(int(r.cell), waited, float64(r.expires-r.created)/1e9)
		// Per block its release would free: a hold that shares every
		// block frees none, and goes last.
		value := math.Inf(1)
		if own := e.own(r); own > 0 {
			value = float64(r.saved) * p / float64(own)
			if tier > 0 {
				// demoted, not dropped: the tier's copy keeps most of it
				value *= 1 - (1-tierKeep)*b.prefill.tierShare(b.tombs.hash(r.key), tier, n)
			}
		}
		if b.cfg.value != nil {
			value = b.cfg.value(e.held(r), time.Duration(n-r.created), value)
		}
		cands = append(cands, cand{
			value:   value,
			prob:    p,
			created: r.created,
			slot:    uint32(i),
		})
	}
	b.model.mu.Unlock()
	heapify(cands)

	var out []Victim
	freed, taken := int64(0), int64(0)
	limited := false
	for len(cands) > 0 && freed < need {
		c := cands[0]
		last := len(cands) - 1
		cands[0] = cands[last]
		cands = cands[:last]
		siftDown(cands, 0)
		r := &e.recs[c.slot]
		if e.own(r) == 0 {
			continue // frees nothing while other holds share its blocks
		}
		other := byOwner && r.owner != owner
		if other && others >= 0 {
			if taken+int64(r.tokens) > others {
				limited = true
				continue
			}
			taken += int64(r.tokens)
		}
		out = append(out, Victim{Held: e.held(r), Probability: c.prob, Value: c.value, Other: other})
		// Unlinked now, so that a later victim sharing its blocks
		// counts them as its own.
		freed += e.release(r) * bs
	}
	b.cands = cands[:0]
	// Remove after choosing: removal moves records between slots.
	for _, v := range out {
		r := b.removeAt(b.live[v.Key])
		b.bury(r, min(n, r.expires)) // one past its Expires (WithGrace) ended there
		b.stats.Released++
		b.emitEnd(r.key, r.created, min(n, r.expires))
		b.prefill.released(b.tombs.hash(v.Key)) // its next turn goes where its history is (hints.go)
		b.emitPrefilled(v.Key, n)
	}
	return out, limited
}

func heapify(h []cand) {
	for i := len(h)/2 - 1; i >= 0; i-- {
		siftDown(h, i)
	}
}

func siftDown(h []cand, i int) {
	n := len(h)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		c := l
		if r := l + 1; r < n && h[r].before(h[l]) {
			c = r
		}
		if !h[c].before(h[i]) {
			return
		}
		h[i], h[c] = h[c], h[i]
		i = c
	}
}
