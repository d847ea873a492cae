package budget

import "time"

// Applying the other processes' records. A hold is named by its key and
// its creation time: a conversation's turns reuse its key, and an
// addition under a key replaces the older hold there. Records come in the
// journal's order, which is each process's own order but not the order
// of the events across processes: another process may find a handle in
// the store, and return its hold, before the adder's Sync sends the
// addition. So a return or an end of a hold not added yet waits
// (pendingEnds) and ends it when its addition comes; an addition of a
// hold older than the one the ledger holds under its key, or a return or
// an end of one already gone, is stale and changes nothing; a record
// applied twice changes nothing the second time.

// apply applies one record read from the journal at n. b.mu held.
func (b *Budget) apply(raw []byte, n int64) {
	rc, err := decode(raw)
	if err != nil {
		b.stats.Journal.Invalid++
		return
	}
	if rc.source == b.jr.source {
		return
	}
	b.stats.Journal.Applied++
	switch rc.kind {
	case kindAdd:
		b.applyAdd(rc)
	case kindReturn, kindEnd:
		b.applyEnd(rc)
	case kindPrefilled:
		h := b.tombs.hash(rc.key)
		if rc.freed {
			b.prefill.released(h)
		} else if rc.placed.Prefill != "" || rc.placed.Decode != "" {
			b.place(h, rc.placed, rc.at)
		}
	case kindCapacity:
		e := b.engine(rc.engine)
		e.capacity, e.blockSize = max(rc.cap.Tokens, 0), max(rc.cap.BlockSize, 0)
	case kindRunning:
		if rc.at <= n {
			rc.running = nil // its lease is over
		}
		b.setRemote(rc.source, remoteRunning{until: rc.at, tokens: rc.running})
	}
}

// applyAdd adds another process's hold. b.mu held.
func (b *Budget) applyAdd(rc record) {
	h := rc.hold
	if h.validate() != nil {
		b.stats.Journal.Invalid++
		return
	}
	c := h.Created.UnixNano()
	newer := b.newer(h.Key, c-1)
	// A pending end waits past additions of later holds (the turn that
	// returned a hold retains the next under its key).
	if pe, ok := b.jr.pending.get(h.Key); ok && named(c, pe.want, pe.upTo) {
		b.jr.pending.del(h.Key)
		b.addEnded(h, rc.owner, pe, newer)
		return
	}
	if newer {
		b.stats.Journal.Stale++
		return
	}
	b.insert(h, rc.owner)
}

// newer reports whether the ledger holds, or watched the end of, a hold
// under key created after c. b.mu held.
func (b *Budget) newer(key string, c int64) bool {
	if l, ok := b.live[key]; ok && b.recAt(l).created > c {
		return true
	}
	tb, ok := b.tombs.peek(key)
	return ok && tb.created > c
}

// addEnded applies the addition of h, whose return or end pe was read
// before it. With a newer hold under its key (the conversation's next
// turn, through this process), only its return is observed. b.mu held.
func (b *Budget) addEnded(h Hold, owner uint64, pe pendingEnd, newer bool) {
	if !newer {
		b.insert(h, owner)
		b.endNamed(pe.kind, h.Key, h.Created.UnixNano(), pe.at)
		return
	}
	if pe.kind != kindReturn {
		b.stats.Journal.Stale++
		return
	}
	b.model.mu.Lock()
	cell := b.model.cellOf(h.Features, true)
	b.model.mu.Unlock()
	c := h.Created.UnixNano()
	b.observe(cell, c, pe.at-c, true)
	b.stats.Returned++
}

// applyEnd applies another process's return or end of a hold: of the one
// it names, now or when its addition comes. b.mu held.
func (b *Budget) applyEnd(rc record) {
	if b.endNamed(rc.kind, rc.key, rc.created, rc.at) {
		return
	}
	if rc.created != 0 && b.newer(rc.key, rc.created) {
		b.stats.Journal.Stale++ // a hold already replaced here
		return
	}
	b.jr.pending.add(rc.key, pendingEnd{want: rc.created, upTo: rc.at, at: rc.at, kind: rc.kind})
}

// endNamed returns (kindReturn) or ends (kindEnd) at at the hold under key
// created at want (0: any created by at), and reports whether it found
// it, live or ended. b.mu held.
func (b *Budget) endNamed(kind byte, key string, want, at int64) bool {
	if kind == kindReturn {
		live, created := b.returnAt(key, at, want, at)
		return live || created != 0
	}
	if l, ok := b.live[key]; ok && named(b.recAt(l).created, want, at) {
		r := b.removeAt(l)
		b.bury(r, min(at, r.expires))
		b.stats.Ended++
		return true
	}
	tb, ok := b.tombs.peek(key)
	return ok && named(tb.created, want, at) // ended here already
}

// pendingEnds are the returns and ends read before the additions of
// their holds, by key, until their addition comes or pendingFor passes.
type pendingEnds struct {
	m map[string]pendingEnd
	q deadlineQueue[string]
}

// pendingFor is how long a return or an end waits for its hold's
// addition: past the decode engine's TTL, the hold is gone anyway.
const pendingFor = 10 * time.Minute

// maxPending bounds the returns and ends waiting.
const maxPending = 4 * JournalQueue

type pendingEnd struct {
	want, upTo, at int64 // the hold's creation time (0: any by upTo); the return's or end's time
	kind           byte
	deadline       int64
}

func newPendingEnds() pendingEnds { return pendingEnds{m: map[string]pendingEnd{}} }

func (p *pendingEnds) add(key string, pe pendingEnd) {
	if len(p.m) >= maxPending {
		return
	}
	pe.deadline = pe.at + int64(pendingFor)
	p.m[key] = pe
	p.q.push(key, pe.deadline)
}

func (p *pendingEnds) get(key string) (pendingEnd, bool) {
	pe, ok := p.m[key]
	return pe, ok
}

func (p *pendingEnds) del(key string) { delete(p.m, key) }

func (p *pendingEnds) len() int { return len(p.m) }

// due drops the entries past their deadline at now.
func (p *pendingEnds) due(now int64) {
	p.q.expire(now, func(key string, deadline int64) {
		if pe, ok := p.m[key]; ok && pe.deadline == deadline {
			delete(p.m, key)
		}
	})
}
