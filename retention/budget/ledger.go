package budget

import (
	"iter"
	"time"
)

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
	blocks    int64 // distinct: each shared block once
	// nodes are the blocks of the holds' prefixes, by chained identity:
	// a tree (each block's parent is the one before it) whose paths from
	// the first blocks are the holds' prefixes, with how many holds pass
	// through each. Its size is bounded by the distinct blocks held.
	nodes map[uint64]node
}

// node is one block of the holds' prefixes.
type node struct {
	parent uint64 // the block before it (0 for a first block)
	refs   uint32 // the holds whose prefix passes through it
}

// rec is one live hold: 80 bytes, and the key's bytes (shared with the
// index's map key).
type rec struct {
	key     string
	created int64  // UnixNano
	expires int64  // UnixNano
	owner   uint64 // Hold.Owner's hash
	leaf    uint64 // its prefix's last block in engine.nodes
	linked  uint32 // its prefix's blocks in engine.nodes, of blocks
	tokens  uint32
	blocks  uint32
	saved   float32 // seconds
	cell    uint32  // the gap model's cell of its features
	heap    uint32  // its position in engine.heap
}

// chain is a block's identity in engine.nodes: its caller's identity
// mixed with its parent's, so that a block is the same only when every
// block before it is too (vLLM's hash_block_tokens chains the same way).
func chain(parent, h uint64) uint64 {
	x := parent ^ (h * 0x9e3779b97f4a7c15)
	x ^= x >> 31
	x *= 0xbf58476d1ce4e5b9
	x ^= x >> 29
	x *= 0x94d049bb133111eb
	x ^= x >> 32
	return x | 1 // never 0, the first blocks' parent
}

// link references the first n blocks of prefix for one hold and returns
// its last block, how many it linked, and how many were new to e.
func (e *engine) link(prefix iter.Seq[uint64], n int) (leaf uint64, linked uint32, fresh int64) {
	if prefix == nil || n <= 0 {
		return 0, 0, 0
	}
	if e.nodes == nil {
		e.nodes = map[uint64]node{}
	}
	for h := range prefix {
		id := chain(leaf, h)
		nd, ok := e.nodes[id]
		if !ok {
			nd.parent = leaf
			fresh++
		}
		nd.refs++
		e.nodes[id] = nd
		leaf = id
		if linked++; int(linked) == n {
			break
		}
	}
	return leaf, linked, fresh
}

// unlink drops one hold's reference to its linked blocks, from leaf back
// to the first, and returns how many no hold references any more (the
// blocks the engine frees with it).
func (e *engine) unlink(leaf uint64, linked uint32) (freed int64) {
	for id := leaf; linked > 0; linked-- {
		nd, ok := e.nodes[id]
		if !ok || nd.refs == 0 {
			return freed // not the tree link built: a hash collision
		}
		if nd.refs--; nd.refs == 0 {
			delete(e.nodes, id)
			freed++
		} else {
			e.nodes[id] = nd
		}
		id = nd.parent
	}
	return freed
}

// own is how many of r's blocks no other hold references: its unlinked
// blocks (the partial last one, or all of a hold without Prefix) and the
// end of its prefix that only it passes through.
func (e *engine) own(r *rec) int64 {
	n := int64(r.blocks - r.linked)
	for id, k := r.leaf, r.linked; k > 0; k-- {
		nd, ok := e.nodes[id]
		if !ok || nd.refs > 1 {
			break
		}
		n++
		id = nd.parent
	}
	return n
}

// release unlinks r's prefix ahead of its removal (Victims counts what
// each victim frees as it chooses it) and returns the blocks freed.
func (e *engine) release(r *rec) int64 {
	freed := int64(r.blocks-r.linked) + e.unlink(r.leaf, r.linked)
	e.blocks -= freed
	e.tokens -= int64(r.tokens)
	r.blocks, r.tokens, r.linked, r.leaf = 0, 0, 0, 0
	return freed
}

// loc is where a live hold's record is.
type loc struct {
	eng, slot uint32
}

// push adds r, with the first n blocks of prefix linked, and returns its
// slot.
func (e *engine) push(prefix iter.Seq[uint64], n int, r rec) uint32 {
	var fresh int64
	r.leaf, r.linked, fresh = e.link(prefix, n)
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
