package budget

import (
	"math"
	"math/bits"
)

// PrefixGranule is the tokens of prefix the ledger counts as shared or
// not as one at the start of the holds' prefixes ([Hold.Prefix]), in
// blocks of PrefixGranule / block size (at least one): where holds part
// within their first [PrefixDense] granules, fewer than a granule of
// their blocks in common are counted for each; further on, fewer than
// 1/16 of the prefix they share.
const PrefixGranule = 256

// PrefixDense is how many granules from a prefix's start the ledger
// reads each of; after them it reads 16 per doubling of the prefix.
const PrefixDense = 32

// granule is the blocks of a granule for blocks of bs tokens.
func granule(bs int) int { return max(1, PrefixGranule/max(bs, 1)) }

// step is how many granules follow granule j (1-based) to the next one
// read: 1 up to PrefixDense, then 2 up to twice as many, 4 up to four
// times, and so on: 16 per doubling, each at most 1/16 of j. From a
// granule read, j+step(j) is read too, so the positions read are the
// same from whatever granule they are walked.
func step(j int) int {
	return 1 << max(0, bits.Len(uint(j))-bits.Len(PrefixDense-1))
}

// link references, for one hold, the first n blocks of p by nodes at
// fixed positions: the last block of granules 1, 2, ..., PrefixDense,
// then of every second one up to twice as many, every fourth up to four
// times, and so on (step). It returns its last node, the blocks its
// nodes span and how many of them were new to e.
//
// Why sampled, and what it costs in accuracy: a node per block costs a
// map update per block at Add and at the hold's end (1,563 of each for a
// 25,000-token history at blocks of 16, 0.3 ms of a turn's 0.9 ms in
// token verification), and the hold's blocks are most often its own. p's
// hashes are chained over every token up to their block's end (two
// holds' block i hash equal only when their first i+1 blocks are equal),
// so one block's hash names the whole prefix before it and needs no
// chaining here; the positions are the same for every hold, so that
// holds with a common prefix meet on the same nodes, and a node's span
// of blocks is shared when the node is. Two holds whose first k blocks
// match share the nodes up to k; their blocks in common after the last
// of those are counted for each, as are the blocks after a hold's last
// node. The count is never below the engine's distinct blocks (each held
// block is counted at least once), and over them by less than the span
// of the next node after the point where a hold parts from the others,
// per hold after the first: less than a granule (256 tokens) where they
// part within the first 32 granules (8,192 tokens: system prompts and
// tools, where different conversations share), less than 1/16 of the
// prefix they share beyond (forks of one long conversation), and less
// than the same after a hold's last node. An overcount, never an
// undercount: a ledger within its budget has the engine within it too.
// The nodes are 56 for a 25,000-token hold and 88 for 100,000 (a node
// per granule: 97 and 390), each a probe of e.nodes at Add and at the
// hold's end; e.nodes holds at most one per distinct block held.
func (e *engine) link(p Blocks, n, bs int) (leaf uint64, linked uint32, fresh int64) {
	if p == nil {
		return 0, 0, 0
	}
	g := granule(bs)
	n = min(n, p.Len())
	if n < g {
		return 0, 0, 0
	}
	// Nodes of another block size never meet these (the engine's block
	// size changed between holds): their positions differ.
	salt := uint64(bs) * 0x9e3779b97f4a7c15
	for j := 1; j*g <= n; j += step(j) {
		id := p.At(j*g-1) ^ salt
		nd := e.nodes.find(id)
		if nd == nil {
			nd = e.nodes.add(id)
			nd.parent, nd.span = leaf, uint32(j*g)-linked
			fresh += int64(nd.span)
		} else if nd.refs == 1 {
			e.reshared() // its hold's own count changes
		}
		nd.refs++
		leaf = id
		linked = uint32(j * g)
	}
	return leaf, linked, fresh
}

// unlink drops one hold's reference to its nodes, from leaf back to the
// first (linked blocks), and returns the blocks no hold references any
// more (those the engine frees with it).
func (e *engine) unlink(leaf uint64, linked uint32) (freed int64) {
	for id, k := leaf, int64(linked); k > 0; {
		nd := e.nodes.find(id)
		if nd == nil {
			return freed // not the tree link built: a hash collision
		}
		k -= int64(nd.span)
		id = nd.parent
		switch nd.refs--; nd.refs {
		case 0:
			freed += int64(nd.span)
			e.nodes.remove(nd)
		case 1:
			e.reshared() // its other hold's own count changes
		}
	}
	return freed
}

// own is how many of r's blocks no other hold references: its unlinked
// blocks (those after its last node, with the partial last one, or all
// of a hold without Prefix) and the spans of the nodes at the end of its
// prefix that only it passes through. Those change only when a node
// changes between one hold and more (e.shares): own walks r's nodes
// once, and again only after such a change, not on every call (Victims
// asks for each hold of an engine over its budget).
func (e *engine) own(r *rec) int64 {
	if r.ownedAt == e.shares+1 {
		return int64(r.owned)
	}
	n := int64(r.blocks - r.linked)
	for id, k := r.leaf, int64(r.linked); k > 0; {
		nd := e.nodes.find(id)
		if nd == nil || nd.refs != 1 {
			break
		}
		n += int64(nd.span)
		k -= int64(nd.span)
		id = nd.parent
	}
	r.owned, r.ownedAt = uint32(n), e.shares+1
	return n
}

// reshared counts a node's change between one hold and more: every
// hold's own count is to be walked again. (Once in 2^32 changes the
// counter starts over, and every record is marked so.)
func (e *engine) reshared() {
	if e.shares++; e.shares == math.MaxUint32 {
		e.shares = 0
		for i := range e.recs {
			e.recs[i].ownedAt = 0
		}
	}
}

// release unlinks r's prefix ahead of its removal (Victims counts what
// each victim frees as it chooses it) and returns the blocks freed.
func (e *engine) release(r *rec) int64 {
	freed := int64(r.blocks-r.linked) + e.unlink(r.leaf, r.linked)
	e.blocks -= freed
	e.tokens -= int64(r.tokens)
	r.blocks, r.tokens, r.linked, r.leaf, r.ownedAt = 0, 0, 0, 0, 0
	return freed
}
