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
}

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
// tokens, tells; a figure the page refused keeps its last value. It
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
	p.unseen = 0
	if p.usage >= 0 && p.capacity > 0 {
		p.unseen = max(int64(p.usage*float64(p.capacity)+0.5)-held-live, 0)
	}
	return p.capacity, p.blockSize
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
