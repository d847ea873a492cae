package sim

import (
	"fmt"
	"strings"
)

// Chain exposes the KV chain to the tests: the kv value of each of toks
// computed from the model seed at positions 0, 1, ...
func Chain(model string, toks []uint32) []uint64 { return chain(Seed(model), toks, 0) }

// CheckPools verifies every rank's block accounting: a block is in the
// free queue exactly when nothing references it; the blocks of running
// and loading requests and of active holds are referenced; the prefix
// cache names only blocks that say they are cached.
func (e *Engine) CheckPools() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	for k, r := range e.ranks {
		p := r.pool
		inFree := map[*block]bool{}
		for el := p.free.Front(); el != nil; el = el.Next() {
			b := el.Value.(*block)
			if inFree[b] {
				return fmt.Errorf("rank %d: block %d twice in the free queue", k, b.id)
			}
			inFree[b] = true
		}
		for _, b := range p.blocks[1:] {
			if (b.ref == 0) != inFree[b] {
				return fmt.Errorf("rank %d: block %d has %d references, in free queue %t", k, b.id, b.ref, inFree[b])
			}
			if b.ref < 0 {
				return fmt.Errorf("rank %d: block %d has %d references", k, b.id, b.ref)
			}
		}
		for h, b := range p.cache {
			if !b.cached || b.hash != h {
				return fmt.Errorf("rank %d: cache names block %d, which holds another hash", k, b.id)
			}
		}
		for _, h := range r.active {
			for _, b := range h.seq.blocks {
				if b.ref < 1 {
					return fmt.Errorf("rank %d: hold %s on an unreferenced block %d", k, h.id, b.id)
				}
			}
		}
		for _, t := range r.running {
			for _, b := range t.seq.blocks {
				if b.ref < 1 {
					return fmt.Errorf("rank %d: running request on an unreferenced block %d", k, b.id)
				}
			}
		}
		if len(r.running) == 0 && r.loading == 0 && len(r.loaded) == 0 {
			// idle: every reference is a hold's
			want := map[*block]int{}
			for _, h := range r.active {
				for _, b := range h.seq.blocks {
					want[b]++
				}
			}
			for _, b := range p.blocks[1:] {
				if b.ref != want[b] {
					return fmt.Errorf("rank %d: idle block %d has %d references, %d holds", k, b.id, b.ref, want[b])
				}
			}
		}
	}
	return nil
}

// DebugQueues describes every rank's waiting queue.
func (e *Engine) DebugQueues() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	var b strings.Builder
	for k, r := range e.ranks {
		fmt.Fprintf(&b, "engine %p ", e)
		fmt.Fprintf(&b, "rank %d: free %d running %d loading %d expiry armed %t at %v holds %d\n", k, r.pool.freeCount(), len(r.running), r.loading, r.expiryStop != nil, r.expiryAt, len(r.active))
		for _, t := range r.running {
			fmt.Fprintf(&b, "  running %p: state %d n %d done %d blocks %d parked %t timer %t phase %d recompute %t preemptions %d aborted %t finished %t status %d\n",
				t, t.state, t.n, t.done, len(t.seq.blocks), t.parked, t.stopWork != nil, t.phase, t.recompute, t.rec.Preemptions, t.rec.Aborted, t.rec.finished, t.rec.Status)
		}
		for _, t := range r.loaded {
			fmt.Fprintf(&b, "  loaded %p: n %d blocks %d parked %t\n", t, len(t.toks), len(t.seq.blocks), t.parked)
		}
		for _, t := range r.waiting {
			toks := t.toks
			if t.started {
				toks = t.allToks[:t.sofar()]
			}
			hits := r.pool.lookup(toks)
			fmt.Fprintf(&b, "  waiting %p: state %d n %d started %t sofar %d hits %d need %d parked %t\n", t, t.state, len(t.toks), t.started, len(toks), len(hits), (len(toks)+r.pool.bs-1)/r.pool.bs-len(hits), t.parked)
		}
	}
	return b.String()
}

// DropCPUChunk deletes chunk i of toks from rank 0's CPU tier, as an
// eviction of that one chunk would; it reports whether it was there.
func (e *Engine) DropCPUChunk(toks []uint32, i int) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	c := e.ranks[0].tier
	keys := c.keys(toks, e.cfg.CPUTier.algo(), "")
	ch, ok := c.chunks[keys[i]]
	if ok {
		c.lru.Remove(ch.elem)
		delete(c.chunks, ch.key)
	}
	return ok
}
