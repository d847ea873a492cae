package decodemem

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/metricspage"
)

// Pressure is what kvroute last read of one decode engine's /metrics
// (its KV capacity and block size, the share of its KV memory in use, its
// waiting requests and preemptions), its max_model_len, and the tokens of
// the decode legs in flight on it. The zero value has read nothing; it is
// safe for concurrent use.
type Pressure struct {
	mu          sync.Mutex
	at          time.Time // when it was read (router clock); zero: never
	tried       time.Time // when a read last began: a failed one waits the interval too
	capacity    int64     // KV tokens; 0 unknown
	blockSize   int
	usage       float64 // 0 to 1; -1 unknown
	waiting     int
	preemptions float64 // the counter
	preempted   bool    // the counter grew since the reading before
	held        int64   // the ledger's held tokens on the engine when read
	// unseen is what the engine's usage showed beyond the ledger's holds
	// and this router's live legs when read: KV this router does not
	// account for (another router's holds or legs, streams whose holds
	// carry no handle, orphaned holds); 0 when usage or capacity is
	// unknown.
	unseen int64
	// maxModelLen is the engine's max_model_len (its GET /v1/models; 0
	// unknown), read when its process started at lenStart.
	maxModelLen int64
	lenStart    time.Time
	// noCapacity says why no KV capacity is known for the engine (its
	// /metrics could not be read, or carry no vllm:cache_config_info);
	// empty when one is, or before the first reading.
	noCapacity string

	// Reading: a read of its /metrics is running (started for pressure).
	Reading atomic.Bool
	// LenReading: a read of its /v1/models is running.
	LenReading atomic.Bool
	// Live is the tokens of the decode legs in flight on the engine.
	Live atomic.Int64

	// ended: the decode legs that left the live count and whose holds
	// the ledger may not count yet (Ended, Retained, Begin).
	ended endedLegs
}

// endedLegs is what a reading counts of the decode legs that ended on an
// engine (their answer whole: the engine still holds their blocks) before
// their retain added the hold to the ledger. Its lock is held across the
// ledger call each of Ended, Retained and Begin runs, so that a reading's
// snapshot of the ledger and of the ended legs is of one instant: a leg
// is in the ledger's live legs, among the ended legs or in its holds,
// never in none of them and never in two.
type endedLegs struct {
	mu sync.Mutex
	// cur ended since the last reading began; old before it, and were
	// counted by it. A leg not retained by the reading after (its retain
	// refused it, the leg broke, the engine failed) is no longer counted:
	// what it left on the engine is released or freed.
	cur, old legCount
}

// legCount is a number of legs and their tokens.
type legCount struct{ n, tokens int64 }

// Reading is one snapshot of a Pressure.
type Reading struct {
	// At is when the last reading began (zero: never); Last is the later
	// of At and when a read was last tried.
	At, Last    time.Time
	Usage       float64 // 0 to 1; -1 unknown
	Waiting     int
	Preemptions float64
	Preempted   bool  // the counter grew since the reading before
	Capacity    int64 // KV tokens; 0 unknown
	BlockSize   int
	Held        int64 // the ledger's held tokens on the engine when read
	// Unseen is the KV in use on the engine beyond the ledger's holds and
	// the router's live legs at the reading (usage × capacity − Held −
	// live, at least 0; 0 unknown): KV the router does not account for.
	Unseen      int64
	MaxModelLen int64 // 0 unknown
}

// Snapshot returns what is known now.
func (p *Pressure) Snapshot() Reading {
	p.mu.Lock()
	defer p.mu.Unlock()
	last := p.at
	if p.tried.After(last) {
		last = p.tried
	}
	return Reading{At: p.at, Last: last, Usage: p.usage, Waiting: p.waiting, Preemptions: p.preemptions, Preempted: p.preempted,
		Capacity: p.capacity, BlockSize: p.blockSize, Held: p.held, Unseen: p.unseen, MaxModelLen: p.maxModelLen}
}

// Try records that a read is tried at now.
func (p *Pressure) Try(now time.Time) {
	p.mu.Lock()
	p.tried = now
	p.mu.Unlock()
}

// ReadSince reports whether a reading began at or after now.
func (p *Pressure) ReadSince(now time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return !p.at.Before(now)
}

// Record records what page, a reading begun at now with the ledger
// holding held tokens on the engine and the router's decode legs live
// tokens (in flight, and ended with their holds not yet in the ledger:
// Begin), tells; a figure the page refused keeps its last value. It
// returns the engine's capacity and the block size its handles follow
// (0: unknown).
func (p *Pressure) Record(now time.Time, held, live int64, page *metricspage.Page) (capacity int64, blockSize int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.at.IsZero() {
		p.usage = -1 // unknown until a good reading
	}
	p.at, p.held = now, held
	if !page.BadUsage {
		p.usage = -1
		if page.Usages > 0 {
			p.usage = page.Usage / float64(page.Usages)
		}
	}
	if !page.BadWaiting {
		p.waiting = page.Waiting
	}
	p.preempted = page.Preempts && p.preemptions > 0 && page.Preemptions > p.preemptions
	if page.Preempts {
		p.preemptions = page.Preemptions
	}
	if tokens, bs, ok := page.Capacity(); ok {
		p.capacity, p.blockSize = tokens, bs
		if size := page.Size(); size > 0 {
			p.blockSize = size // the size its handles' blocks follow
		}
	}
	// live counts the legs that ended before the reading and whose holds
	// were not in held yet (Begin): their blocks are on the engine, and
	// their holds, added after the reading, are counted in the ledger. As
	// unseen KV they were counted twice until the next reading: the next
	// leg's arrival made room it did not need.
	p.unseen = 0
	if p.usage >= 0 && p.capacity > 0 {
		p.unseen = max(int64(p.usage*float64(p.capacity)+0.5)-held-live, 0)
	}
	return p.capacity, p.blockSize
}

// Ended records that a decode leg of tokens left the live count (its
// answer is whole, or the leg is over), while leave takes it off the
// ledger's live legs: until its hold is added (Retained) readings count it
// as the router's own (Begin), not as unseen KV, in whole blocks of
// blockSize tokens (0: unknown) as the engine holds it.
func (p *Pressure) Ended(tokens int64, blockSize int, leave func()) {
	if bs := int64(blockSize); bs > 0 {
		tokens = (tokens + bs - 1) / bs * bs
	}
	p.ended.mu.Lock()
	defer p.ended.mu.Unlock()
	leave()
	p.ended.cur.n++
	p.ended.cur.tokens += tokens
}

// Retained runs add, which adds the hold of a decode leg that ended on the
// engine to the ledger, and ends the count of one ended leg (the oldest
// first; legs are counted by number and tokens, so one of average size).
func (p *Pressure) Retained(add func()) {
	p.ended.mu.Lock()
	defer p.ended.mu.Unlock()
	add()
	c := &p.ended.old
	if c.n == 0 {
		c = &p.ended.cur
	}
	if c.n > 0 {
		c.tokens -= c.tokens / c.n
		c.n--
		if c.n == 0 {
			c.tokens = 0
		}
	}
}

// Begin begins a reading: it runs snap, which reads the ledger's holds and
// live legs on the engine, and returns the tokens of the legs that ended
// and whose holds are not in the ledger yet (Ended): they are on the
// engine and the router's own. The legs the reading before counted and
// that were not retained since are counted for the last time.
func (p *Pressure) Begin(snap func()) (ended int64) {
	p.ended.mu.Lock()
	defer p.ended.mu.Unlock()
	snap()
	ended = p.ended.old.tokens + p.ended.cur.tokens
	p.ended.old, p.ended.cur = p.ended.cur, legCount{}
	return ended
}

// ModelLenKnown reports whether max_model_len is known for the process
// that started at start (zero: unknown start).
func (p *Pressure) ModelLenKnown(start time.Time) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.maxModelLen > 0 && (start.IsZero() || start.Equal(p.lenStart))
}

// SetModelLen records max_model_len n of the process that started at
// start.
func (p *Pressure) SetModelLen(n int64, start time.Time) {
	p.mu.Lock()
	p.maxModelLen, p.lenStart = n, start
	p.mu.Unlock()
}

// SetNoCapacity records why no KV capacity is known for the engine (""
// once one is), and reports whether that is news: the reason was empty
// before and is not now.
func (p *Pressure) SetNoCapacity(why string) (news bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	news = p.noCapacity == "" && why != ""
	p.noCapacity = why
	return news
}

// NoCapacity says why no KV capacity is known for the engine, "" when one
// is (or before the first reading).
func (p *Pressure) NoCapacity() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.noCapacity
}
