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
	// nodes are the holds' prefixes, sampled: one node per granule of
	// blocks (link), keyed by the hash of the granule's last block, a
	// tree (each node's parent is the granule before it) whose paths
	// from the first granules are the holds' linked prefixes, with how
	// many holds pass through each. It has at most one entry per
	// granule held: the engine's distinct held blocks / the granule.
	nodes map[uint64]node
}

// node is one granule of the holds' prefixes: 16 bytes.
type node struct {
	parent uint64 // the granule before it (none for a first one: walks count spans)
	refs   uint32 // the holds whose prefix passes through it
	span   uint32 // its blocks
}

// rec is one live hold: 72 bytes, and the key's bytes (shared with the
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
}

// PrefixGranule is the tokens of prefix the ledger counts shared or not
// as one (the granule of [Hold.Prefix]'s sharing): PrefixGranule /
// block size blocks, at least one.
const PrefixGranule = 256

// granule is the blocks of a node for blocks of bs tokens.
func granule(bs int) int { return max(1, PrefixGranule/max(bs, 1)) }

// link references, for one hold, the first n blocks of p, one node per
// granule of g = granule(bs) blocks, and returns its last node, the
// blocks its nodes span and how many of them were new to e.
//
// Why sampled, and what it costs in accuracy: a node per block costs a
// map update per block at Add and at the hold's end (1,563 of each for a
// 25,000-token history at blocks of 16: 0.3 ms of a turn's 0.9 ms in
// token verification). p's hashes are chained over every token up to
// their block's end (two holds' block i hash equal only when their first
// i+1 blocks are equal), so one block's hash names the whole prefix
// before it and needs no chaining here: the node of a granule is the
// hash of its last block, at the same positions (blocks g-1, 2g-1, ...)
// for every hold on the engine, so that holds with a common prefix meet
// on the same nodes. Two holds whose first k blocks match share the
// floor(k/g) granules of them; the k mod g blocks of the granule where
// they part are counted for each, as are the blocks after a hold's last
// full granule (fewer than g). The count is never below the engine's
// distinct blocks (every held block is counted at least once) and over
// it by at most g-1 blocks per hold after the first on the engine: an
// overcount, never an undercount, so that a ledger within its budget
// has the engine within it too. A node per granule of 256 tokens is 16
// times fewer map updates at blocks of 16 (98 at 25,000 tokens). Denser
// sampling for the first blocks (system prompts, tools) would make the
// granule vary with the position, and so the stated bound.
func (e *engine) link(p Blocks, n, bs int) (leaf uint64, linked uint32, fresh int64) {
	if p == nil {
		return 0, 0, 0
	}
	g := granule(bs)
	n = min(n, p.Len())
	if n < g {
		return 0, 0, 0
	}
	if e.nodes == nil {
		e.nodes = map[uint64]node{}
	}
	// Nodes of another block size never meet these (the engine's block
	// size changed between holds): their positions differ.
	salt := uint64(bs) * 0x9e3779b97f4a7c15
	for i := g - 1; i < n; i += g {
		id := p.At(i) ^ salt
		nd, ok := e.nodes[id]
		if !ok {
			nd = node{parent: leaf, span: uint32(g)}
			fresh += int64(g)
		}
		nd.refs++
		e.nodes[id] = nd
		leaf = id
		linked += uint32(g)
	}
	return leaf, linked, fresh
}

// unlink drops one hold's reference to its nodes, from leaf back to the
// first (linked blocks), and returns the blocks no hold references any
// more (those the engine frees with it).
func (e *engine) unlink(leaf uint64, linked uint32) (freed int64) {
	for id, k := leaf, int64(linked); k > 0; {
		nd, ok := e.nodes[id]
		if !ok || nd.refs == 0 {
			return freed // not the tree link built: a hash collision
		}
		if nd.refs--; nd.refs == 0 {
			delete(e.nodes, id)
			freed += int64(nd.span)
		} else {
			e.nodes[id] = nd
		}
		k -= int64(nd.span)
		id = nd.parent
	}
	return freed
}

// own is how many of r's blocks no other hold references: its unlinked
// blocks (those after its last granule, with the partial last one, or
// all of a hold without Prefix) and the nodes at the end of its prefix
// that only it passes through.
func (e *engine) own(r *rec) int64 {
	n := int64(r.blocks - r.linked)
	for id, k := r.leaf, int64(r.linked); k > 0; {
		nd, ok := e.nodes[id]
		if !ok || nd.refs != 1 {
			break
		}
		n += int64(nd.span)
		k -= int64(nd.span)
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
