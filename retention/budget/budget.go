package budget

import (
	"math"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Budget is the ledger of the decode memory held for retained handles, by
// decode engine, with the gap model that predicts which holds will be
// used, and the choice of which to release when an engine's holds go over
// its budget ([Budget.Victims]). The caller reports each hold's life:
// [Budget.Add] when a turn stores a handle, [Budget.Return] when a later
// turn looks its key up (whether or not it attaches it), [Budget.End]
// when the hold goes without one (the store evicted it, or the caller
// released it itself); expiry is seen from each hold's Expires (and
// [Budget.Expired] hands the holds past it to a caller that releases
// them: [WithGrace]). A Budget
// only knows, and only releases, the holds its callers added. Several
// callers may share one (router replicas in one process sharing a store:
// kvroute's DecodeMemory.Ledger): each adds its holds, a return through
// any of them ends the hold once, Victims chooses among every caller's
// holds of the engine, and the gap model learns from every return; each
// releases only what it took from the store. Callers in other processes
// share their Budgets' state through a [Journal] ([WithJournal],
// [Budget.Sync]): each process's Budget then holds every process's holds,
// capacities, running requests and learned pauses, a sync interval late.
//
// Time is the caller's: every method that needs it takes now, and holds
// carry their own times. A Budget is safe for concurrent use.
type Budget struct {
	mu      sync.Mutex
	cfg     config
	model   *Model
	live    map[string]loc
	engines []*engine
	byName  map[string]uint32
	tombs   tombstones
	stats   Stats
	cands   []cand           // scratch for Victims
	running map[string]int64 // Running's tokens, by engine, of this process
	jr      *journal         // WithJournal's; nil without
	prefill prefilled        // SetPrefilled's records (hints.go)
	tier    atomic.Int64     // SetCPUTier's capacity in tokens (hints.go)
}

// Stats counts what a Budget has seen since it was made.
type Stats struct {
	// Holds and Tombstones are the holds live now and the ended ones
	// still watched for their conversation's next turn.
	Holds, Tombstones int
	// Added counts holds added; Replaced those added under a key that
	// already held one (the earlier is dropped unobserved).
	Added, Replaced int64
	// Returned counts next turns that found their hold live;
	// ReturnedAfterEnd those that came after it ended (expired or
	// released) but within the horizon.
	Returned, ReturnedAfterEnd int64
	// Expired, Released and Ended count holds that went without a next
	// turn: past their Expires, chosen by Victims, or by End. Overdue
	// counts those of Expired that [Budget.Expired] handed to a caller to
	// release.
	Expired, Released, Ended, Overdue int64
	// Censored counts ended holds whose conversation had not come back
	// within the horizon.
	Censored int64
	// ClassesOverflow counts holds of classes past WithMaxClasses,
	// learned only in the overall figures.
	ClassesOverflow int64
	// PrefixIgnored counts holds added with a [Hold.Prefix] of another
	// block size than their engine's: each of their blocks was counted as
	// its own.
	PrefixIgnored int64
	// Journal counts the ledger's exchange through [WithJournal]'s
	// journal (all zero without one).
	Journal JournalStats
}

// Capacity is a decode engine's KV memory, from its /metrics
// (vllm:cache_config_info's num_gpu_blocks × block_size) or configured.
type Capacity struct {
	// Tokens is the KV capacity in tokens; 0: unknown, the budget's
	// WithCapacity applies.
	Tokens int64
	// BlockSize is the tokens per block; 0: the budget's WithBlockSize.
	BlockSize int
}

// New returns a Budget. It fails, wrapping [ErrInvalidConfig] and naming
// the option, when an option is out of range.
func New(opts ...Option) (*Budget, error) {
	c := defaultConfig()
	for _, o := range opts {
		o.apply(&c)
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return &Budget{
		cfg:    c,
		model:  newModel(c),
		live:   map[string]loc{},
		byName: map[string]uint32{},
		tombs:  newTombstones(),
		jr:     newJournal(c),
	}, nil
}

// engine returns the engine named name, adding it. b.mu held.
func (b *Budget) engine(name string) *engine {
	if i, ok := b.byName[name]; ok {
		return b.engines[i]
	}
	e := &engine{name: strings.Clone(name)}
	b.byName[e.name] = uint32(len(b.engines))
	b.engines = append(b.engines, e)
	return e
}

func (b *Budget) blockSize(e *engine) int {
	if e.blockSize > 0 {
		return e.blockSize
	}
	return b.cfg.blockSize
}

// budgetTokens is e's budget in tokens, 0 when its capacity is unknown.
func (b *Budget) budgetTokens(e *engine) int64 {
	c := e.capacity
	if c == 0 {
		c = b.cfg.capacity
	}
	return int64(math.Floor(b.cfg.fraction * float64(c)))
}

// SetCapacity records engine's KV capacity, as its /metrics report it.
// Holds already added keep the block count of their time.
func (b *Budget) SetCapacity(engine string, c Capacity) {
	b.mu.Lock()
	defer b.mu.Unlock()
	e := b.engine(engine)
	tokens, bs := max(c.Tokens, 0), max(c.BlockSize, 0)
	if e.capacity != tokens || e.blockSize != bs {
		e.capacity, e.blockSize = tokens, bs
		b.emitCapacity(e)
	}
}

// Add records a hold. A hold already recorded under its key is replaced
// (counted in [Stats.Replaced], not observed as a gap). It fails, wrapping
// [ErrInvalidHold], on a hold without key, engine or tokens, or that
// expires before it is created.
//
// A decode-local turn answered on the engine that holds the conversation
// stores no new handle: call Return for the key (the conversation came
// back), then Add the same hold again with Created at the turn's end and
// the new turn number, and its old Expires.
func (b *Budget) Add(h Hold) error {
	if err := h.validate(); err != nil {
		return err
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	prefix, bs := b.insert(h, ownerHash(h.Owner))
	b.emitAdd(h, prefix, bs)
	return nil
}

// insert records h, a valid hold of the owner of that hash, replacing the
// hold under its key, and returns the prefix it linked (nil: none) and
// its engine's block size. b.mu held.
func (b *Budget) insert(h Hold, owner uint64) (Blocks, int) {
	now := h.Created.UnixNano()
	b.expire(now)
	if l, ok := b.live[h.Key]; ok && !b.endOverdue(l, now) {
		b.removeAt(l)
		b.stats.Replaced++
	}
	e := b.engine(h.Engine)
	bs := b.blockSize(e)
	b.model.mu.Lock()
	before := b.model.overflow
	cell := b.model.cellOf(h.Features, true)
	b.stats.ClassesOverflow += b.model.overflow - before
	b.model.mu.Unlock()
	key := strings.Clone(h.Key)
	prefix := h.Prefix
	if prefix != nil && h.PrefixBlockSize != bs {
		prefix = nil
		b.stats.PrefixIgnored++
	}
	slot := e.push(prefix, h.Tokens/bs, bs, rec{
		key:     key,
		created: now,
		expires: h.Expires.UnixNano(),
		tokens:  uint32(h.Tokens),
		blocks:  uint32((h.Tokens + bs - 1) / bs),
		saved:   float32(h.Saved.Seconds()),
		cell:    uint32(cell),
		owner:   owner,
	})
	b.live[key] = loc{eng: b.byName[e.name], slot: slot}
	b.stats.Added++
	return prefix, bs
}

// removeAt deletes the live hold at l and returns its record. b.mu held.
func (b *Budget) removeAt(l loc) rec {
	e := b.engines[l.eng]
	gone, moved := e.remove(l.slot)
	delete(b.live, gone.key)
	if moved != nil {
		b.live[moved.key] = loc{eng: l.eng, slot: l.slot}
	}
	return gone
}

// Return records that a turn looked up key at now: the conversation came
// back. It reports whether the hold was live (and removes it from the
// ledger: the caller takes it from the store, attaches or releases it).
// A hold that had already ended within the horizon is observed as a late
// return; an unknown key is ignored.
func (b *Budget) Return(key string, now time.Time) bool {
	n := now.UnixNano()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(n)
	live, created := b.returnAt(key, n, 0, math.MaxInt64)
	b.emitReturn(key, created, n)
	return live
}

// returnAt observes key's return at n: of its live hold, or of its
// tombstone, when the hold's creation time is want (0: any created at or
// before upTo). It reports whether the hold was live and the creation
// time of the hold or tombstone it found (0: none). b.mu held.
func (b *Budget) returnAt(key string, n, want, upTo int64) (live bool, created int64) {
	if l, ok := b.live[key]; ok && named(b.recAt(l).created, want, upTo) {
		c := b.recAt(l).created
		if !b.endOverdue(l, n) {
			r := b.removeAt(l)
			b.observe(int(r.cell), r.created, n-r.created, true)
			b.stats.Returned++
			return true, c
		}
	}
	if tb, ok := b.tombs.peek(key); ok && named(tb.created, want, upTo) {
		b.tombs.take(key)
		if n <= tb.deadline {
			b.observe(int(tb.cell), tb.created, n-tb.created, true)
			b.stats.ReturnedAfterEnd++
		} else {
			b.observe(int(tb.cell), tb.created, tb.deadline-tb.created, false)
			b.stats.Censored++
		}
		return false, tb.created
	}
	return false, 0
}

// named reports whether a hold created at c is the one named by want
// (its creation time; 0: any created before upTo, the time of the return
// or end that names it).
func named(c, want, upTo int64) bool {
	if want == 0 {
		return c < upTo
	}
	return c == want
}

// recAt is the live hold at l. b.mu held.
func (b *Budget) recAt(l loc) *rec { return &b.engines[l.eng].recs[l.slot] }

// Lookup returns key's live hold, as of the last call that took a time
// (a hold past its Expires may still be listed until then).
func (b *Budget) Lookup(key string) (Held, bool) {
	b.mu.Lock()
	defer b.mu.Unlock()
	l, ok := b.live[key]
	if !ok {
		return Held{}, false
	}
	e := b.engines[l.eng]
	return e.held(&e.recs[l.slot]), true
}

// End records that key's hold went at now without its conversation's next
// turn: the store evicted it, or the caller released it outside
// [Budget.Victims]. The conversation is still watched for the horizon. It
// reports whether the hold was live.
func (b *Budget) End(key string, now time.Time) bool {
	n := now.UnixNano()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(n)
	l, ok := b.live[key]
	if !ok {
		return false
	}
	r := b.recAt(l)
	created, at := r.created, min(n, r.expires)
	if !b.endOverdue(l, n) {
		b.bury(b.removeAt(l), n)
		b.stats.Ended++
	}
	b.emitEnd(key, created, at)
	return true
}

// endOverdue ends the hold at l as an expired one if it is past its
// Expires at now (kept for WithGrace), and reports whether it was. b.mu
// held.
func (b *Budget) endOverdue(l loc, now int64) bool {
	if b.engines[l.eng].recs[l.slot].expires > now {
		return false
	}
	r := b.removeAt(l)
	b.bury(r, r.expires)
	b.stats.Expired++
	return true
}

// Expired ends and returns engine's holds past their Expires at now, kept
// in the ledger for [WithGrace] while the engine still pins them: the
// caller takes each one's key from the store and releases it. They end
// as expired holds do (counted in [Stats.Expired], watched for their
// conversation's next turn from their Expires). It costs a look at the
// engine's earliest expiry when none is past it.
func (b *Budget) Expired(engine string, now time.Time) []Held {
	n := now.UnixNano()
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(n)
	i, ok := b.byName[engine]
	if !ok {
		return nil
	}
	e := b.engines[i]
	var out []Held
	for {
		slot, ok := e.next()
		if !ok || e.recs[slot].expires > n {
			return out
		}
		r := &e.recs[slot]
		out = append(out, e.held(r))
		b.emitEnd(r.key, r.created, r.expires)
		b.endOverdue(loc{eng: i, slot: slot}, n)
		b.stats.Overdue++
	}
}

// bury remembers an ended hold for the horizon from end. b.mu held.
func (b *Budget) bury(r rec, end int64) {
	tb := tomb{created: r.created, deadline: end + int64(b.cfg.horizon), cell: r.cell}
	if old, ok := b.tombs.add(r.key, tb); ok {
		// The key ended twice with no turn between: the earlier one had
		// waited until now.
		b.observe(int(old.cell), old.created, min(end, old.deadline)-old.created, false)
		b.stats.Censored++
	}
}

// observe records a closed observation in the model. b.mu held.
func (b *Budget) observe(cell int, created, age int64, returned bool) {
	b.model.mu.Lock()
	b.model.close(cell, created, float64(max(age, 0))/1e9, returned)
	b.model.mu.Unlock()
}

// expire ends the holds past their Expires (and WithGrace) and censors the tombstones
// past their deadline, as of now. b.mu held.
func (b *Budget) expire(now int64) {
	for i, e := range b.engines {
		for {
			slot, ok := e.next()
			if !ok || e.recs[slot].expires+int64(b.cfg.grace) > now {
				break
			}
			r := b.removeAt(loc{eng: uint32(i), slot: slot})
			b.bury(r, r.expires)
			b.stats.Expired++
		}
	}
	b.tombs.due(now, func(tb tomb) {
		b.observe(int(tb.cell), tb.created, tb.deadline-tb.created, false)
		b.stats.Censored++
	})
}

// refresh recomputes the model's probabilities at now if they are stale,
// with every live hold and tombstone as an open observation. b.mu held.
func (b *Budget) refresh(now int64, force bool) {
	b.model.mu.Lock()
	defer b.model.mu.Unlock()
	if !force && !b.model.stale(now) {
		return
	}
	b.model.refresh(now, func(add func(id int, created int64)) {
		for _, e := range b.engines {
			for i := range e.recs {
				add(int(e.recs[i].cell), e.recs[i].created)
			}
		}
		for _, tb := range b.tombs.m {
			add(int(tb.cell), tb.created)
		}
	})
}

// Probability is the chance, per the gap model, that the next turn of a
// conversation with features f comes after waited and by until (both
// since its last turn ended), given it has not come by waited. The model
// is refreshed first if its probabilities are older than WithRefresh.
func (b *Budget) Probability(f Features, waited, until time.Duration, now time.Time) float64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := now.UnixNano()
	b.expire(n)
	b.refresh(n, false)
	b.model.mu.Lock()
	defer b.model.mu.Unlock()
	return b.model.probability(b.model.cellOf(f, false), seconds(waited), seconds(until))
}

// Snapshot reports the gap model, refreshed at now, with the chance of a
// next turn within window by feature.
func (b *Budget) Snapshot(now time.Time, window time.Duration) Snapshot {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := now.UnixNano()
	b.expire(n)
	b.refresh(n, true)
	return b.model.Snapshot(window)
}

// Running adds delta to the tokens of the requests running on engine, as
// its callers count them (kvroute counts a decode leg from its arrival
// until its answer is whole), and returns the sum: callers sharing the
// Budget see one another's. Holds do not count in it, nor it in Held or
// the budget; a caller that makes room for running requests passes what
// they need to [Budget.Victims] as incoming. It costs a map lookup.
func (b *Budget) Running(engine string, delta int64) int64 {
	b.mu.Lock()
	defer b.mu.Unlock()
	n := b.running[engine] + delta
	switch {
	case n != 0 && b.running == nil:
		b.running = map[string]int64{engine: n}
	case n != 0:
		b.running[engine] = n
	case delta != 0:
		delete(b.running, engine)
	}
	return n + b.jr.running(engine)
}

// Forget drops from the ledger every engine that keep rejects and that
// holds nothing now and runs nothing ([Budget.Running]): what the ledger
// knew of it (its capacity, block size, prefix table) goes with it, and a
// later Add or SetCapacity for it starts afresh. It returns how many it
// dropped; keep is called without the Budget's lock held. Engines come and go (a Kubernetes pod's address is new each
// time), so a caller forgets those that left its pool (kvroute does, every
// second, with the engines its Router no longer lists): the ledger's size
// then follows the engines in use, not all that ever were. An engine
// that still holds is kept until its holds end (returned, released or
// expired). It costs a pass over the engines.
func (b *Budget) Forget(now time.Time, keep func(engine string) bool) int {
	// idle: holds and runs nothing, here or in another process. b.mu held.
	idle := func(e *engine) bool { return len(e.recs) == 0 && b.running[e.name] == 0 && b.jr.running(e.name) == 0 }
	var names []string
	b.mu.Lock()
	b.expire(now.UnixNano())
	for _, e := range b.engines {
		if idle(e) {
			names = append(names, e.name)
		}
	}
	b.mu.Unlock()
	// keep is asked without the lock: it may take locks of its own that
	// are held while the ledger is called.
	gone := map[string]bool{}
	for _, n := range names {
		if !keep(n) {
			gone[n] = true
		}
	}
	if len(gone) == 0 {
		return 0
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	dropped := 0
	for i := 0; i < len(b.engines); {
		e := b.engines[i]
		if !gone[e.name] || !idle(e) {
			i++ // kept, or busy again since
			continue
		}
		last := len(b.engines) - 1
		delete(b.byName, e.name)
		if i != last {
			moved := b.engines[last]
			b.engines[i] = moved
			b.byName[moved.name] = uint32(i)
			for slot, r := range moved.recs {
				b.live[r.key] = loc{eng: uint32(i), slot: uint32(slot)}
			}
		}
		b.engines[last] = nil
		b.engines = b.engines[:last]
		dropped++
	}
	return dropped
}

// Stats returns the counters and sizes, as of the last call that took a
// time.
func (b *Budget) Stats() Stats {
	b.mu.Lock()
	defer b.mu.Unlock()
	s := b.stats
	s.Holds, s.Tombstones = len(b.live), b.tombs.len()
	if b.jr != nil {
		s.Journal.Pending, s.Journal.Sources = b.jr.pending.len(), len(b.jr.remote)
	}
	return s
}
