package budget

import (
	"cmp"
	"slices"
	"sync"
	"time"
)

// Where a conversation was prefilled. A hold released to make room costs
// its conversation's next turn only what the prefill engine that serves
// that turn lacks in its prefix cache: little on the engine that
// prefilled the turn before (it cached that prompt), the history since
// that engine last saw the conversation anywhere else. So the caller
// records, with each hold, the prefill engine of its turn
// ([Budget.SetPrefilled]), and a next turn that finds no hold to attach
// asks where to prefill ([Budget.Prefilled]). Like the holds and the gap
// model, the record is shared by every caller of the Budget (router
// replicas sharing one ledger) and, with [WithJournal], by the other
// processes' ledgers (the record and the release, a Sync later), so a turn
// served through another replica than the one that released the hold
// still finds it.

// prefilled remembers, by a 64-bit hash of the hold's key (as tombstones
// do: about 40 bytes each), the prefill engine of each hold's turn for
// the horizon.
type prefilled struct {
	mu sync.Mutex
	m  map[uint64]prefilledAt
	q  deadlineQueue[uint64]
	// touched is, per decode engine, the turns placed on it in the order
	// they were recorded: each read or wrote its whole sequence in the
	// engine's CPU tier, which moves it to the tier's most recent end. A
	// record's LRU age is what the later, still current ones touched.
	touched map[string][]access
	seq     int64
}

type prefilledAt struct {
	endpoint string
	deadline int64 // UnixNano
	released bool  // Victims chose the hold
	decode   string
	tokens   int
	seq      int64 // its access in touched[decode]
}

// access is a turn's touch of its decode engine's CPU tier: tokens from
// seq on, until deadline; superseded once its conversation's later turn
// on the same engine touched them again (Placement.Prior): those chunks
// then count once, at the later place.
type access struct {
	seq, deadline int64
	tokens        int
	superseded    bool
}

// SetPrefilled records that the turn whose hold is under key was
// prefilled on endpoint (whose prefix cache then holds its prompt), for
// [Budget.Prefilled] once [Budget.Victims] releases the hold, until the
// horizon ([WithHorizon]) from now. An empty endpoint records nothing.
func (b *Budget) SetPrefilled(key, endpoint string, now time.Time) {
	b.SetPlaced(key, Placement{Prefill: endpoint}, now)
}

// Placement is where a retained turn ran: its prefill engine, and its
// decode engine with what that engine's CPU tier (vLLM's
// OffloadingConnector, writing every sealed block through) holds of the
// turn. The decode engine's tier evicts least recently used first, and
// every request reads or writes its whole sequence there (a lookup
// touches what it finds, a store touches what it stored), so what a
// record's turn left there is still resident while the tokens the later
// turns on that engine touched ([Budget.Placed]'s after) and its own fit
// the tier: a released hold's KV stays reachable there (demoted, not
// dropped) until the engine's later traffic pushes it out.
type Placement struct {
	// Prefill is the turn's prefill engine ("" when unknown), as
	// [Budget.SetPrefilled] records it.
	Prefill string
	// Decode is the turn's decode engine ("" when unknown: no tier
	// record).
	Decode string
	// Tokens are the turn's tokens the decode engine's CPU tier holds
	// once it ends: its prompt and, when the engine writes generated
	// blocks too, its answer, in whole blocks.
	Tokens int
	// Prior is the key of the conversation's previous turn's record when
	// it ran on the same decode engine ("" otherwise): this turn touched
	// that turn's tokens again (its history), so they count once, here.
	Prior string
}

// SetPlaced records p for the turn whose hold is under key, as
// SetPrefilled does its prefill engine (p.Prefill, for
// [Budget.Prefilled]), and counts p.Tokens as touched last on p.Decode's
// CPU tier. Shared by the Budget's callers
// and, with [WithJournal], the other processes' ledgers. An empty key, or
// a p with neither engine, records nothing.
func (b *Budget) SetPlaced(key string, p Placement, now time.Time) {
	if key == "" || p.Prefill == "" && p.Decode == "" {
		return
	}
	p.Tokens = max(p.Tokens, 0)
	n := now.UnixNano()
	b.place(b.tombs.hash(key), p, n)
	b.mu.Lock()
	defer b.mu.Unlock()
	b.emitPlaced(key, p, n)
}

// Placed returns the record [Budget.SetPlaced] made for key's turn within
// the horizon, and after: the tokens the later turns placed on its decode
// engine touched in its CPU tier, each conversation counted once, at its
// latest turn there (ok false: none). What the turn left in a tier of C
// tokens is, for a least-recently-used tier, about min(Tokens, C - after)
// leading tokens (a request's tail is evicted before its head; the LRU
// stack distance). Counted from the records of every process sharing the
// journal; a decode engine's traffic no router saw (other clients, turns
// not retained) is not counted, so the estimate errs toward residency: a
// pull that then misses loads nothing and costs a recompute, never a
// wrong token (the tier is addressed by token hashes). With a tier
// capacity ([Budget.SetCPUTier]) the count stops there.
func (b *Budget) Placed(key string, now time.Time) (p Placement, after int64, ok bool) {
	h := b.tombs.hash(key)
	q := &b.prefill
	q.mu.Lock()
	defer q.mu.Unlock()
	q.expire(now.UnixNano())
	return q.placed(h, now.UnixNano(), b.tier.Load())
}

// placed is the record of the hold hashed h within its horizon at now and
// the tokens the current later accesses on its decode engine touched
// (Placed), counted up to limit (0: all). p.mu held.
func (p *prefilled) placed(h uint64, now, limit int64) (pl Placement, after int64, ok bool) {
	at, ok := p.m[h]
	if !ok || at.deadline <= now {
		return Placement{}, 0, false
	}
	pl = Placement{Prefill: at.endpoint, Decode: at.decode, Tokens: at.tokens}
	if at.decode == "" {
		return pl, 0, true
	}
	log := p.touched[at.decode]
	for i := len(log) - 1; i >= 0 && log[i].seq > at.seq; i-- {
		if a := log[i]; !a.superseded && a.deadline > now {
			after += int64(a.tokens)
			if limit > 0 && after >= limit {
				break
			}
		}
	}
	return pl, after, true
}

// Resident estimates the leading tokens of p's turn its decode engine's
// CPU tier of capacity tokens still holds after the tokens later turns
// touched there (after, [Budget.Placed]), in whole blocks of blockSize (0
// or 1: tokens): the tier evicts least recently used first and a
// request's tail before its head, so the newer tokens leave capacity -
// after for the turn's head.
func (p Placement) Resident(capacity int, after int64, blockSize int) int {
	if capacity <= 0 || p.Decode == "" || p.Tokens <= 0 {
		return 0
	}
	left := int64(capacity) - after
	if left <= 0 {
		return 0
	}
	n := int(min(int64(p.Tokens), left))
	if blockSize > 1 {
		n -= n % blockSize
	}
	return n
}

// SetCPUTier tells the Budget its decode engines' CPU tier capacity in
// tokens (0: none). With a tier, a hold whose turn the tier is estimated
// to hold ([Budget.Placed], [Placement.Resident]) is worth less on the
// GPU: releasing it demotes the history to the tier (a later turn pulls it
// from there) rather than dropping it, so [Budget.Victims] releases such
// holds first. A hold's value keeps tierKeep of what the tier holds of it:
// what a GPU pull saves over the tier's (the network copy and the
// host-to-device load) is about a tenth of a prefill's time.
func (b *Budget) SetCPUTier(tokens int) {
	b.tier.Store(int64(max(tokens, 0)))
}

// tierKeep is the share of a hold's value the tier's copy of it leaves.
const tierKeep = 0.1

// tierShare is the share of the hold hashed h that the decode engines'
// tier of capacity tokens is estimated to hold, 0 without a record.
func (p *prefilled) tierShare(h uint64, capacity int, now int64) float64 {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl, after, ok := p.placed(h, now, int64(capacity))
	if !ok || pl.Tokens <= 0 {
		return 0
	}
	return float64(pl.Resident(capacity, after, 0)) / float64(pl.Tokens)
}

// place records p for the hold hashed h at n, for the horizon: from
// SetPlaced, or from another process's record (the journal).
func (b *Budget) place(h uint64, p Placement, n int64) {
	prior := uint64(0)
	if p.Prior != "" {
		prior = b.tombs.hash(p.Prior)
	}
	b.prefill.set(h, prior, p, n, int64(b.cfg.horizon))
}

// set records pl for the hold hashed h, from n for horizon: a later
// turn's record, not released; prior is the hash of pl.Prior (0: none),
// whose access on the same engine this one supersedes.
func (p *prefilled) set(h, prior uint64, pl Placement, n, horizon int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expire(n)
	if p.m == nil {
		p.m = map[uint64]prefilledAt{}
		p.touched = map[string][]access{}
	}
	d := n + horizon
	at := prefilledAt{endpoint: pl.Prefill, deadline: d, decode: pl.Decode, tokens: pl.Tokens}
	if pl.Decode != "" {
		log := p.touched[pl.Decode]
		supersede := func(k uint64) {
			if was, ok := p.m[k]; ok && was.decode == pl.Decode {
				if i, found := slices.BinarySearchFunc(log, was.seq, func(a access, seq int64) int { return cmp.Compare(a.seq, seq) }); found {
					log[i].superseded = true
				}
			}
		}
		supersede(h) // the same turn recorded again
		if prior != 0 {
			supersede(prior)
		}
		p.seq++
		at.seq = p.seq
		p.touched[pl.Decode] = append(log, access{seq: p.seq, deadline: d, tokens: pl.Tokens})
	}
	p.m[h] = at
	p.q.push(h, d)
}

// Prefilled returns the prefill engine recorded for key's turn
// ([Budget.SetPrefilled]) within the horizon when [Budget.Victims] (or
// VictimsFor) released its hold: "" when none is, or the hold was not
// released so (it was attached, expired or is still live). Only the
// releases a Budget chooses move its callers' turns: with memory to
// spare, nothing is placed otherwise than without it.
func (b *Budget) Prefilled(key string, now time.Time) string {
	h := b.tombs.hash(key)
	p := &b.prefill
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expire(now.UnixNano())
	if at, ok := p.m[h]; ok && at.released && at.deadline > now.UnixNano() && at.endpoint != "" {
		return at.endpoint
	}
	return ""
}

// released marks key's record, if any, as of a hold Victims released.
func (p *prefilled) released(h uint64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if at, ok := p.m[h]; ok {
		at.released = true
		p.m[h] = at
	}
}

// expire forgets the records whose horizon ended by now. p.mu held.
func (p *prefilled) expire(now int64) {
	p.q.expire(now, func(h uint64, deadline int64) {
		if at, ok := p.m[h]; ok && at.deadline == deadline {
			delete(p.m, h)
		}
	})
	// An access past its deadline counts for no record (every record
	// older than it is past its own): drop the leading ones.
	for e, log := range p.touched {
		i := 0
		for i < len(log) && log[i].deadline <= now {
			i++
		}
		switch {
		case i == len(log):
			delete(p.touched, e)
		case i > len(log)/2:
			p.touched[e] = slices.Clone(log[i:])
		case i > 0:
			p.touched[e] = log[i:]
		}
	}
}
