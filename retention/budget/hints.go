package budget

import (
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
}

type prefilledAt struct {
	endpoint string
	deadline int64 // UnixNano
	released bool  // Victims chose the hold
}

// SetPrefilled records that the turn whose hold is under key was
// prefilled on endpoint (whose prefix cache then holds its prompt), for
// [Budget.Prefilled] once [Budget.Victims] releases the hold, until the
// horizon ([WithHorizon]) from now. An empty endpoint records nothing.
func (b *Budget) SetPrefilled(key, endpoint string, now time.Time) {
	if key == "" || endpoint == "" {
		return
	}
	n := now.UnixNano()
	b.prefill.set(b.tombs.hash(key), endpoint, n, int64(b.cfg.horizon))
	b.mu.Lock()
	defer b.mu.Unlock()
	b.emitPrefilled(key, endpoint, false, n)
}

// set records endpoint for the hold hashed h, from n for horizon: a later
// turn's record, not released.
func (p *prefilled) set(h uint64, endpoint string, n, horizon int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.expire(n)
	if p.m == nil {
		p.m = map[uint64]prefilledAt{}
	}
	d := n + horizon
	p.m[h] = prefilledAt{endpoint: endpoint, deadline: d}
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
	if at, ok := p.m[h]; ok && at.released && at.deadline > now.UnixNano() {
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
}
