package budget

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"maps"
	"reflect"
	"sync"
	"time"
)

// Journal carries a ledger's changes between the processes whose Budgets
// share it ([WithJournal]): an ordered log of opaque records, each one
// change of one Budget, that every process appends to and reads. Records
// are the Budget's own encoding (its holds' keys, engines, sizes, times,
// features, owner hashes and the prefix hashes it samples; never a
// prompt); the Journal stores and returns them unchanged, in one order
// for every reader. It keeps at least the records of the holds that may
// still be live (the decode engine's TTL, 480 s by default), so that a
// process that starts reads them, and may drop older ones. A Journal is
// safe for concurrent use.
type Journal interface {
	// Append adds records at the journal's end, in order.
	Append(ctx context.Context, records [][]byte) error
	// Read returns at most max records after cursor ("": from the oldest
	// kept), in order, and the cursor after the last of them (cursor
	// itself when there are none). A cursor older than the oldest record
	// kept reads from the oldest.
	Read(ctx context.Context, cursor string, max int) (records [][]byte, next string, err error)
}

// JournalQueue is how many changes a Budget queues for its journal
// between two [Budget.Sync] calls; past it, changes are dropped (counted
// in [JournalStats.Dropped]) and the other processes miss them: a hold
// they never see added, a return they never see (the hold then counts
// there until it expires).
const JournalQueue = 16384

// JournalLease is how long the running requests a process reports
// ([Budget.Running]) count in the other processes' ledgers after its
// report: each Sync reports them again when they changed or half the
// lease has passed, so those of a process that stops (it died, or lost
// its journal) stop counting a lease after its last report. It is on the
// reporting process's clock: the processes' clocks must agree to within
// a fraction of it (NTP).
const JournalLease = 10 * time.Second

// Bounds of one Sync's reads: journalPage records a Read, journalPages
// Reads (a process that starts reads a long journal over several Syncs).
const (
	journalPage  = 1024
	journalPages = 16
)

// JournalStats counts a Budget's exchange with its journal.
type JournalStats struct {
	// Appended and Applied count the records sent and the other
	// processes' records applied.
	Appended, Applied int64
	// Dropped counts changes not sent: past JournalQueue, or of a failed
	// Append that no longer fit the queue.
	Dropped int64
	// Errors counts the Syncs whose Append or Read failed; Invalid the
	// records read that could not be decoded (skipped).
	Errors, Invalid int64
	// Stale counts the others' changes that named a hold this ledger had
	// already replaced or ended (a late or repeated record), applied as
	// nothing.
	Stale int64
	// Pending is the returns and ends of holds whose addition had not
	// been read yet (another process found the handle in the store
	// before its adder's Sync): each ends its hold as soon as its
	// addition is read.
	Pending int
	// Sources is how many other processes' running requests count now
	// (their lease not over).
	Sources int
	// Synced is the time of the last Sync that appended and read without
	// error (zero: none).
	Synced time.Time
}

// journal is a Budget's side of its Journal. Its fields, but syncMu, are
// guarded by the Budget's mu.
type journal struct {
	j       Journal
	source  string
	syncMu  sync.Mutex // one Sync at a time
	queue   [][]byte
	cursor  string
	pending pendingEnds
	// remote is the other processes' running tokens by source, and sum
	// their total by engine.
	remote map[string]remoteRunning
	sum    map[string]int64
	// sent is the running tokens last reported, at sentAt.
	sent    map[string]int64
	sentAt  int64
	scratch []byte
}

type remoteRunning struct {
	until  int64 // UnixNano
	tokens map[string]int64
}

// newJournal is the journal of a Budget configured with c (nil without
// one).
func newJournal(c config) *journal {
	if c.journal == nil {
		return nil
	}
	src := c.source
	if src == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		src = hex.EncodeToString(b[:])
	}
	return &journal{j: c.journal, source: src, pending: newPendingEnds(),
		remote: map[string]remoteRunning{}, sum: map[string]int64{}}
}

// journalName names j for Inherit's comparison.
func journalName(j Journal) string {
	if j == nil {
		return "nil"
	}
	if v := reflect.ValueOf(j); v.Kind() == reflect.Pointer {
		return fmt.Sprintf("%T(%#x)", j, v.Pointer())
	}
	return fmt.Sprintf("%T(%v)", j, j)
}

// running is the other processes' running tokens on engine. nil-safe.
func (jr *journal) running(engine string) int64 {
	if jr == nil {
		return 0
	}
	return jr.sum[engine]
}

// push queues a record. b.mu held.
func (b *Budget) push(rec []byte) {
	jr := b.jr
	if len(jr.queue) >= JournalQueue {
		b.stats.Journal.Dropped++
		return
	}
	jr.queue = append(jr.queue, rec)
}

// Sync appends the changes queued since the last Sync to the journal
// ([WithJournal]) and applies, at now, the changes the other processes
// appended since. Call it regularly (every second or so) and never on a
// turn's path: it waits for the journal (bound it with ctx's deadline).
// It returns the Append's or Read's error, also counted in
// [JournalStats.Errors]; the changes of a failed Append are queued again
// (within [JournalQueue]), so a journal that comes back gets them. A
// Budget without a journal returns nil at once. One Sync runs at a time;
// the Budget's other methods are not held up by its waits.
func (b *Budget) Sync(ctx context.Context, now time.Time) error {
	b.mu.Lock()
	jr := b.jr
	b.mu.Unlock()
	if jr == nil {
		return nil
	}
	jr.syncMu.Lock()
	defer jr.syncMu.Unlock()
	n := now.UnixNano()
	b.mu.Lock()
	b.emitRunning(n)
	out, cursor := jr.queue, jr.cursor
	jr.queue = nil
	b.mu.Unlock()

	var errs []error
	if len(out) > 0 {
		if err := jr.j.Append(ctx, out); err != nil {
			errs = append(errs, fmt.Errorf("budget: journal append: %w", err))
			b.mu.Lock()
			keep := min(len(out), max(JournalQueue-len(jr.queue), 0))
			b.stats.Journal.Dropped += int64(len(out) - keep)
			jr.queue = append(out[:keep:keep], jr.queue...)
			b.mu.Unlock()
		} else {
			b.mu.Lock()
			b.stats.Journal.Appended += int64(len(out))
			b.mu.Unlock()
		}
	}
	for range journalPages {
		recs, next, err := jr.j.Read(ctx, cursor, journalPage)
		if err != nil {
			errs = append(errs, fmt.Errorf("budget: journal read: %w", err))
			break
		}
		b.mu.Lock()
		for _, r := range recs {
			b.apply(r, n)
		}
		jr.cursor = next
		b.mu.Unlock()
		cursor = next
		if len(recs) < journalPage {
			break
		}
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.expire(n)
	jr.pending.due(n)
	b.leases(n)
	if len(errs) > 0 {
		b.stats.Journal.Errors++
		return errors.Join(errs...)
	}
	b.stats.Journal.Synced = now
	return nil
}

// leases drops the running tokens of the sources whose lease is over at
// n. b.mu held.
func (b *Budget) leases(n int64) {
	jr := b.jr
	for src, rr := range jr.remote {
		if rr.until <= n {
			b.setRemote(src, remoteRunning{})
		}
	}
}

// setRemote replaces source's running tokens by rr's (none: rr zero).
// b.mu held.
func (b *Budget) setRemote(source string, rr remoteRunning) {
	jr := b.jr
	for e, t := range jr.remote[source].tokens {
		if jr.sum[e] -= t; jr.sum[e] == 0 {
			delete(jr.sum, e)
		}
	}
	if len(rr.tokens) == 0 {
		delete(jr.remote, source)
		return
	}
	jr.remote[source] = rr
	for e, t := range rr.tokens {
		jr.sum[e] += t
	}
}

// emitRunning queues a report of this process's running tokens when they
// changed since the last or half the lease has passed. b.mu held.
func (b *Budget) emitRunning(n int64) {
	jr := b.jr
	if maps.Equal(jr.sent, b.running) && (len(b.running) == 0 || n-jr.sentAt < int64(JournalLease)/2) {
		return
	}
	jr.sent, jr.sentAt = maps.Clone(b.running), n
	b.push(encodeRunning(jr.source, n+int64(JournalLease), b.running))
}

// emitAdd queues h's addition, with the prefix the ledger linked (of
// blocks of bs tokens). b.mu held.
func (b *Budget) emitAdd(h Hold, prefix Blocks, bs int) {
	if b.jr != nil {
		b.push(encodeAdd(b.jr.source, h, prefix, bs))
	}
}

// emitReturn queues the return of key's hold created at created (0: the
// ledger knew none: the one its adder holds, created by n). b.mu held.
func (b *Budget) emitReturn(key string, created, n int64) {
	if b.jr == nil {
		return
	}
	if created == 0 {
		// Its addition may be read later: the hold ends then.
		b.jr.pending.add(key, pendingEnd{upTo: n, at: n, kind: kindReturn})
	}
	b.push(encodeEnd(kindReturn, b.jr.source, key, created, n))
}

// emitEnd queues the end, without a return, of key's hold created at
// created, watched from at. b.mu held.
func (b *Budget) emitEnd(key string, created, at int64) {
	if b.jr != nil {
		b.push(encodeEnd(kindEnd, b.jr.source, key, created, at))
	}
}

// emitPrefilled queues that Victims released key's hold at n. b.mu held.
func (b *Budget) emitPrefilled(key string, n int64) {
	if b.jr != nil {
		b.push(encodePrefilled(b.jr.source, key, Placement{}, true, n))
	}
}

// emitPlaced queues key's turn's placement at n (SetPlaced). b.mu held.
func (b *Budget) emitPlaced(key string, p Placement, n int64) {
	if b.jr != nil {
		b.push(encodePrefilled(b.jr.source, key, p, false, n))
	}
}

// emitCapacity queues e's capacity. b.mu held.
func (b *Budget) emitCapacity(e *engine) {
	if b.jr != nil {
		b.push(encodeCapacity(b.jr.source, e.name, e.capacity, e.blockSize))
	}
}

// ownerHash is the 64-bit FNV-1a hash of a hold's owner: the same in
// every process, so that holds added through a journal keep their owner.
func ownerHash(s string) uint64 {
	h := uint64(14695981039346656037)
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return h
}
