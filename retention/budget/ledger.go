package budget

import "time"

// engine is one decode engine's holds: a dense array of records, a
// min-heap of them by expiry, the blocks they share (Hold.Prefix) and
// their totals.
type engine struct {
	name      string
	capacity  int64 // tokens as reported; 0: the budget's WithCapacity
	blockSize int   // as reported; 0: the budget's WithBlockSize
	recs      []rec
	heap      []uint32 // indices in recs, ordered by rec.expires
	tokens    int64
	blocks    int64 // distinct: each shared block once (to a granule, link)
	// nodes are the holds' prefixes, sampled (link, prefix.go): at most
	// one entry per distinct block held, about one per granule.
	nodes nodes
	// shares counts the changes of a node between one hold and more
	// (rec.owned is valid while it has not changed since).
	shares uint32
}

// rec is one live hold: 80 bytes, and the key's bytes (shared with the
// index's map key).
type rec struct {
	key     string
	created int64  // UnixNano
	expires int64  // UnixNano
	owner   uint64 // Hold.Owner's hash
	leaf    uint64 // its prefix's last node in engine.nodes
	linked  uint32 // the blocks of its nodes, of blocks (the rest its own)
	tokens  uint32
	blocks  uint32
	saved   float32 // seconds
	cell    uint32  // the gap model's cell of its features
	heap    uint32  // its position in engine.heap
	owned   uint32  // engine.own(r), when ownedAt is engine.shares+1
	ownedAt uint32
}

// loc is where a live hold's record is.
type loc struct {
	eng, slot uint32
}

// push adds r, with the first n blocks of prefix (of blocks of bs tokens)
// linked, and returns its slot.
func (e *engine) push(prefix Blocks, n, bs int, r rec) uint32 {
	var fresh int64
	r.leaf, r.linked, fresh = e.link(prefix, n, bs)
	slot := uint32(len(e.recs))
	r.heap = uint32(len(e.heap))
	e.recs = append(e.recs, r)
	e.heap = append(e.heap, slot)
	e.up(int(r.heap))
	e.tokens += int64(r.tokens)
	e.blocks += int64(r.blocks-r.linked) + fresh
	return slot
}

// remove deletes the record at slot and returns it, with the record moved
// into slot (if any) so that the caller can update its index.
func (e *engine) remove(slot uint32) (gone rec, moved *rec) {
	gone = e.recs[slot]
	// Out of the heap: the last heap entry takes its place.
	i, last := int(gone.heap), len(e.heap)-1
	if i != last {
		e.heap[i] = e.heap[last]
		e.recs[e.heap[i]].heap = uint32(i)
	}
	e.heap = e.heap[:last]
	if i != last {
		e.down(i)
		e.up(i)
	}
	// Out of the array: the last record takes its slot.
	lr := len(e.recs) - 1
	if int(slot) != lr {
		e.recs[slot] = e.recs[lr]
		e.heap[e.recs[slot].heap] = slot
		moved = &e.recs[slot]
	}
	e.recs[lr] = rec{}
	e.recs = e.recs[:lr]
	g := gone
	e.release(&g)
	return gone, moved
}

// next returns the slot of the record expiring first.
func (e *engine) next() (uint32, bool) {
	if len(e.heap) == 0 {
		return 0, false
	}
	return e.heap[0], true
}

func (e *engine) less(i, j int) bool {
	return e.recs[e.heap[i]].expires < e.recs[e.heap[j]].expires
}

func (e *engine) swap(i, j int) {
	e.heap[i], e.heap[j] = e.heap[j], e.heap[i]
	e.recs[e.heap[i]].heap = uint32(i)
	e.recs[e.heap[j]].heap = uint32(j)
}

func (e *engine) up(i int) {
	for i > 0 {
		p := (i - 1) / 2
		if !e.less(i, p) {
			return
		}
		e.swap(i, p)
		i = p
	}
}

func (e *engine) down(i int) {
	n := len(e.heap)
	for {
		l := 2*i + 1
		if l >= n {
			return
		}
		c := l
		if r := l + 1; r < n && e.less(r, l) {
			c = r
		}
		if !e.less(c, i) {
			return
		}
		e.swap(i, c)
		i = c
	}
}

// held describes r.
func (e *engine) held(r *rec) Held {
	return Held{
		Key: r.key, Engine: e.name, Tokens: int(r.tokens), Blocks: int(r.blocks),
		Shared: int(int64(r.blocks) - e.own(r)), Created: time.Unix(0, r.created), Expires: time.Unix(0, r.expires),
	}
}
