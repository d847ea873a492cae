package sim

import (
	"container/list"
	"errors"
)

// ErrNoBlocks is returned when the pool has no free block left.
var ErrNoBlocks = errors.New("sim: out of KV cache blocks")

type slot struct {
	tok uint32 // the token the owner believes is here (prefix-cache view)
	kv  uint64 // the data actually held
}

type block struct {
	id     int
	slots  []slot
	ref    int
	hash   uint64
	cached bool
	elem   *list.Element // position in the free queue while ref == 0
}

// pool is a paged KV block pool with vLLM's eviction order: freed blocks go
// to the tail of the free queue (a request's blocks in reverse order, so its
// tail blocks are evicted first); allocation takes from the head. A freed
// block keeps its content and its prefix-cache entry until it is reallocated.
type pool struct {
	bs      int
	caching bool
	blocks  []*block // index = id; blocks[0] is vLLM's null block, never used
	free    *list.List
	cache   map[uint64]*block
}

// newPool makes numBlocks usable blocks (ids 1 to numBlocks) besides the
// null block. A block's slots are made when it is first allocated, so a
// pool sized like a real node's (hundreds of thousands of blocks) costs
// little until it fills.
func newPool(numBlocks, bs int, caching bool) *pool {
	p := &pool{bs: bs, caching: caching, free: list.New(), cache: map[uint64]*block{}}
	p.blocks = make([]*block, numBlocks+1)
	for i := 1; i <= numBlocks; i++ {
		b := &block{id: i}
		b.elem = p.free.PushBack(b)
		p.blocks[i] = b
	}
	return p
}

func (p *pool) freeCount() int { return p.free.Len() }

// size is the number of usable blocks.
func (p *pool) size() int { return len(p.blocks) - 1 }

// allocate takes n blocks from the head of the free queue.
func (p *pool) allocate(n int) ([]*block, error) {
	if n > p.free.Len() {
		return nil, ErrNoBlocks
	}
	out := make([]*block, n)
	for i := range out {
		b := p.free.Remove(p.free.Front()).(*block)
		b.elem = nil
		if b.cached {
			if p.cache[b.hash] == b {
				delete(p.cache, b.hash)
			}
			b.cached = false
		}
		b.ref = 1
		if b.slots == nil {
			b.slots = make([]slot, p.bs)
		}
		out[i] = b
	}
	return out, nil
}

// release drops one reference from each block, in reverse order.
func (p *pool) release(bs []*block) {
	for i := len(bs) - 1; i >= 0; i-- {
		b := bs[i]
		if b.ref <= 0 {
			continue
		}
		b.ref--
		if b.ref == 0 {
			b.elem = p.free.PushBack(b)
		}
	}
}

// touch takes a reference on a cached block found by match.
func (p *pool) touch(b *block) {
	if b.ref == 0 && b.elem != nil {
		p.free.Remove(b.elem)
		b.elem = nil
	}
	b.ref++
}

// blockHashes returns the chained hash of each full block of toks.
func blockHashes(toks []uint32, bs int) []uint64 {
	out := make([]uint64, 0, len(toks)/bs)
	h := uint64(0x84222325cbf29ce4)
	for i := 0; i+bs <= len(toks); i += bs {
		for _, t := range toks[i : i+bs] {
			h = splitmix(h ^ uint64(t)*0xff51afd7ed558ccd)
		}
		out = append(out, h)
	}
	return out
}

// match returns the cached blocks covering the longest block-aligned prefix
// of toks, at most len(toks)-1 tokens (the last prompt token is always
// computed), and takes a reference on each.
func (p *pool) match(toks []uint32) []*block {
	out := p.lookup(toks)
	for _, b := range out {
		p.touch(b)
	}
	return out
}

// lookup is match without taking references.
func (p *pool) lookup(toks []uint32) []*block {
	if !p.caching || len(toks) < 2 {
		return nil
	}
	hs := blockHashes(toks[:len(toks)-1], p.bs)
	var out []*block
	for _, h := range hs {
		b, ok := p.cache[h]
		if !ok || !b.cached || b.hash != h {
			break
		}
		out = append(out, b)
	}
	return out
}

// commit registers the full blocks of a sequence in the prefix cache, keyed
// by the tokens the owner believes they hold.
func (p *pool) commit(bs []*block, toks []uint32) {
	if !p.caching {
		return
	}
	for i, h := range blockHashes(toks, p.bs) {
		if i >= len(bs) {
			return
		}
		b := bs[i]
		if b.cached {
			continue
		}
		if _, taken := p.cache[h]; taken {
			continue
		}
		b.hash, b.cached = h, true
		p.cache[h] = b
	}
}

// seq is the block table of one request.
type seq struct {
	pool   *pool
	blocks []*block
}

func (s *seq) at(pos int) *slot { return &s.blocks[pos/s.pool.bs].slots[pos%s.pool.bs] }

// grow makes the table cover n positions.
func (s *seq) grow(n int) error {
	need := (n + s.pool.bs - 1) / s.pool.bs
	if need <= len(s.blocks) {
		return nil
	}
	bs, err := s.pool.allocate(need - len(s.blocks))
	if err != nil {
		return err
	}
	s.blocks = append(s.blocks, bs...)
	return nil
}

func (s *seq) release() {
	if s.blocks == nil {
		return
	}
	s.pool.release(s.blocks)
	s.blocks = nil
}

func (s *seq) ids() []int {
	out := make([]int, len(s.blocks))
	for i, b := range s.blocks {
		out[i] = b.id
	}
	return out
}

// groupID is block b's id in KV group g: each group numbers its blocks
// apart (group g's ids follow group g-1's), all holding the same data.
func (p *pool) groupID(id, g int) int { return id + g*(len(p.blocks)-1) }

// readBlocks returns the KV data of blocks by id (in any of groups KV
// groups), whatever they hold now.
func (p *pool) readBlocks(idsIn []int, groups int) ([][]uint64, error) {
	n := len(p.blocks) - 1
	out := make([][]uint64, len(idsIn))
	for i, id := range idsIn {
		if id <= 0 || id > groups*n {
			return nil, errBlockID
		}
		b := p.blocks[(id-1)%n+1]
		kv := make([]uint64, p.bs)
		for j, s := range b.slots {
			kv[j] = s.kv
		}
		out[i] = kv
	}
	return out, nil
}

var errBlockID = errors.New("sim: remote block id out of range")
