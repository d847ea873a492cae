package budget

import "hash/maphash"

// nodes is an engine's nodes (prefix.go) by id: an open-addressing hash
// table with linear probing, each node held in its slot. A lookup is a
// probe of one array, mostly one cache line, and an update is made in
// place (a Go map costs a walk of its groups and a second lookup to
// store): the ledger looks a node up for each position of a hold's prefix
// at Add and at its end, mostly out of the caches, so the probes are
// what a turn pays. Slots are at most half full; the table halves when
// an eighth full, so that its size follows the nodes held.
type nodes struct {
	slots []node // a power of two of them, or none
	n     int    // the nodes in slots
	shift uint8  // 64 - log2(len(slots))
	mix   uint64 // a random key of the slots' positions
}

// node is a sampled block of the holds' prefixes: 24 bytes.
type node struct {
	id     uint64 // its block's hash (Blocks.At)
	parent uint64 // the node before it (none for a first one: walks count spans)
	refs   uint32 // the holds whose prefix passes through it; 0: a free slot
	span   uint32 // the blocks from the node before it to its end
}

// minSlots is the least table.
const minSlots = 64

// home is the slot where id's probe starts: its bits mixed with the
// random key (so that ids chosen to collide cannot be chosen), then
// Fibonacci hashing.
func (t *nodes) home(id uint64) int {
	return int(((id ^ t.mix) * 0x9e3779b97f4a7c15) >> t.shift)
}

// find returns id's node, nil when there is none. The pointer is valid
// until the next add or remove.
func (t *nodes) find(id uint64) *node {
	if t.n == 0 {
		return nil
	}
	mask := len(t.slots) - 1
	for i := t.home(id); ; i = (i + 1) & mask {
		s := &t.slots[i]
		if s.refs == 0 {
			return nil
		}
		if s.id == id {
			return s
		}
	}
}

// add returns a new node for id, which has none, with no refs: the
// caller sets them (a node without refs is a free slot). The pointer is
// valid until the next add or remove.
func (t *nodes) add(id uint64) *node {
	if 2*(t.n+1) > len(t.slots) {
		t.resize(max(minSlots, 2*len(t.slots)))
	}
	mask := len(t.slots) - 1
	i := t.home(id)
	for t.slots[i].refs != 0 {
		i = (i + 1) & mask
	}
	t.n++
	t.slots[i] = node{id: id}
	return &t.slots[i]
}

// remove frees s, a node of t, moving back the nodes probed past it
// (backward-shift deletion: no tombstones).
func (t *nodes) remove(s *node) {
	mask := len(t.slots) - 1
	i := t.home(s.id)
	for &t.slots[i] != s {
		i = (i + 1) & mask
	}
	for j := (i + 1) & mask; t.slots[j].refs != 0; j = (j + 1) & mask {
		// The node at j may move to i when its home is not cyclically
		// in (i, j].
		if h := t.home(t.slots[j].id); (j-h)&mask >= (j-i)&mask {
			t.slots[i] = t.slots[j]
			i = j
		}
	}
	t.slots[i] = node{}
	if t.n--; len(t.slots) > minSlots && 8*t.n < len(t.slots) {
		t.resize(len(t.slots) / 2)
	}
}

// resize rehashes t into size slots (a power of two, more than twice
// t.n).
func (t *nodes) resize(size int) {
	old := t.slots
	if t.mix == 0 {
		t.mix = maphash.Comparable(maphash.MakeSeed(), uint64(0)) | 1
	}
	t.slots = make([]node, size)
	t.shift = uint8(64 - log2(size))
	mask := size - 1
	for k := range old {
		if old[k].refs == 0 {
			continue
		}
		i := t.home(old[k].id)
		for t.slots[i].refs != 0 {
			i = (i + 1) & mask
		}
		t.slots[i] = old[k]
	}
}

// log2 is the base-2 logarithm of a power of two.
func log2(n int) int {
	k := 0
	for n > 1 {
		n >>= 1
		k++
	}
	return k
}
