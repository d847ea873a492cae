package budget_test

import (
	"fmt"
	"math/bits"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// ids is a Hold.Prefix of the blocks it names.
type ids []uint64

func (s ids) Len() int        { return len(s) }
func (s ids) At(i int) uint64 { return s[i] }

// seq names the blocks hs.
func seq(hs []uint64) budget.Blocks { return ids(hs) }

// prefixHold is a hold of tokens whose full blocks are named by blocks.
func prefixHold(key string, blocks []uint64, tokens int, created time.Time) budget.Hold {
	return budget.Hold{Key: key, Engine: "d", Tokens: tokens, Created: created, Expires: created.Add(480 * time.Second),
		Saved: time.Second, Prefix: seq(blocks), PrefixBlockSize: 16}
}

// family is n blocks: a shared prefix of the first common ones (ids 1..),
// then blocks of their own (ids from own).
func family(common, n int, own uint64) []uint64 {
	var out []uint64
	for i := range n {
		if i < common {
			out = append(out, uint64(i+1))
		} else {
			out = append(out, own+uint64(i))
		}
	}
	return out
}

// Eight holds that share a 4,096-token prefix (256 blocks of 16) pin it
// once, as the engine's prefix cache stores it: the ledger counts the
// distinct blocks, a hold's release frees only the blocks no other hold
// references, and the last one frees the prefix.
func TestSharedPrefixCountedOnce(t *testing.T) {
	b, err := budget.New(budget.WithBlockSize(16), budget.WithFraction(0.9))
	require.NoError(t, err)
	b.SetCapacity("d", budget.Capacity{Tokens: 1 << 20})
	for i := range 8 {
		// 266 full blocks (256 shared, 10 its own) and a partial one.
		blocks := family(256, 266, uint64(1000*(i+1)))
		require.NoError(t, b.Add(prefixHold(fmt.Sprint("k", i), blocks, 266*16+5, t0)))
	}
	u := b.Usage(t0)[0]
	assert.EqualValues(t, 256+8*11, u.Blocks)
	assert.EqualValues(t, (256+8*11)*16, u.HeldTokens)
	assert.EqualValues(t, 8*(266*16+5), u.Tokens)
	h, ok := b.Lookup("k0")
	require.True(t, ok)
	assert.Equal(t, 267, h.Blocks)
	assert.Equal(t, 256, h.Shared)

	assert.True(t, b.End("k0", t0))
	assert.EqualValues(t, 256+7*11, b.Usage(t0)[0].Blocks, "only k0's own blocks are freed")
	for i := 1; i < 7; i++ {
		b.End(fmt.Sprint("k", i), t0)
	}
	h, _ = b.Lookup("k7")
	assert.Zero(t, h.Shared, "alone, the last hold owns the prefix")
	assert.EqualValues(t, 267, b.Usage(t0)[0].Blocks)
	b.End("k7", t0)
	assert.Zero(t, b.Usage(t0)[0].Blocks)

	// Another block size than the engine's: every block its own, counted.
	hold := prefixHold("x", family(256, 266, 9000), 266*16, t0)
	hold.PrefixBlockSize = 32
	require.NoError(t, b.Add(hold))
	require.NoError(t, b.Add(prefixHold("y", family(256, 266, 8000), 266*16, t0)))
	assert.EqualValues(t, 2*266, b.Usage(t0)[0].Blocks)
	assert.EqualValues(t, 1, b.Stats().PrefixIgnored)
}

// Victims counts what each release frees: holds that share a prefix are
// worth their own blocks, a release frees only those, and a hold whose
// every block another shares is never chosen (its release frees nothing).
func TestVictimsSharedPrefix(t *testing.T) {
	b, err := budget.New(budget.WithBlockSize(16), budget.WithFraction(1))
	require.NoError(t, err)
	// 4 holds of 112 shared (7 granules of 256 tokens) and 10 own full
	// blocks: 152 distinct blocks.
	b.SetCapacity("d", budget.Capacity{Tokens: 152 * 16})
	for i := range 4 {
		require.NoError(t, b.Add(prefixHold(fmt.Sprint("k", i), family(112, 122, uint64(1000*(i+1))), 122*16, t0)))
	}
	// A hold of the shared prefix alone: nothing of its own.
	require.NoError(t, b.Add(prefixHold("p", family(112, 112, 0), 112*16, t0)))
	assert.Nil(t, b.Victims("d", 0, t0), "152 distinct blocks fit 152")
	// Room for 15 blocks: two holds' own blocks, not the prefix.
	v := b.Victims("d", 15*16, t0)
	require.Len(t, v, 2)
	for _, x := range v {
		assert.NotEqual(t, "p", x.Key)
		assert.Equal(t, 112, x.Shared)
	}
	assert.EqualValues(t, 132, b.Usage(t0)[0].Blocks)
	// Room for everything: every hold with blocks of its own goes; p
	// frees nothing while k2 and k3 share its blocks, then everything.
	v = b.Victims("d", 152*16, t0)
	var keys []string
	for _, x := range v {
		keys = append(keys, x.Key)
	}
	assert.Len(t, keys, 3)
	assert.Zero(t, b.Usage(t0)[0].Blocks)
}

// Two holds that part within a granule of 256 tokens: the blocks they
// have in common in it are counted for each (an overcount of fewer than
// a granule), as are a hold's blocks after its last whole granule.
func TestSharedPrefixGranule(t *testing.T) {
	b, err := budget.New(budget.WithBlockSize(16))
	require.NoError(t, err)
	// 40 full blocks each, the first 20 in common: 60 distinct. Granules
	// of 16 blocks: the first is shared; blocks 16..19 are counted twice.
	require.NoError(t, b.Add(prefixHold("a", family(20, 40, 1000), 40*16, t0)))
	require.NoError(t, b.Add(prefixHold("b", family(20, 40, 2000), 40*16, t0)))
	assert.EqualValues(t, 16+2*24, b.Usage(t0)[0].Blocks)
	h, _ := b.Lookup("a")
	assert.Equal(t, 16, h.Shared)
	// A hold that is the first 20 blocks of a: its 4 blocks after the
	// first granule are its own too.
	require.NoError(t, b.Add(prefixHold("c", family(20, 20, 0), 20*16+3, t0)))
	assert.EqualValues(t, 16+2*24+5, b.Usage(t0)[0].Blocks)
	b.End("a", t0)
	b.End("b", t0)
	assert.EqualValues(t, 21, b.Usage(t0)[0].Blocks, "c alone: all its own")
	b.End("c", t0)
	assert.Zero(t, b.Usage(t0)[0].Blocks)
	assert.Zero(t, b.Nodes("d"))
}

// The ledger's blocks, under random adds, ends, returns and victims of
// holds that share prefixes of any length (families of a common system
// prompt, forks of live holds) up to 100 granules, at block sizes whose
// granule is 16, 5, 4 and 1 blocks: never fewer than the engine's
// distinct blocks (a set of every live hold's block hashes, chained),
// never more than those plus, per hold but one, the span of a node at
// its length less a block; exactly the count of the nodes the positions
// read (each granule up to PrefixDense, then one in 2, 4, ...: j with no
// bits set below its 5 highest) and of the blocks after each hold's last
// one; its nodes are those positions' distinct blocks.
func TestSharedPrefixSampledBounds(t *testing.T) {
	for _, bs := range []int{16, 48, 64, 256} {
		t.Run(fmt.Sprint(bs), func(t *testing.T) { sampledBounds(t, bs) })
	}
}

// sampledRead reports whether the ledger reads granule j (1-based).
func sampledRead(j int) bool {
	if j <= budget.PrefixDense {
		return true
	}
	return j%(1<<(bits.Len(uint(j))-5)) == 0
}

func sampledBounds(t *testing.T, bs int) {
	g := max(1, budget.PrefixGranule/bs)
	rng := rand.New(rand.NewPCG(3, uint64(bs)))
	b, err := budget.New(budget.WithBlockSize(bs), budget.WithFraction(1))
	require.NoError(t, err)
	b.SetCapacity("d", budget.Capacity{Tokens: int64(20 * 50 * g * bs)})
	next := uint64(0)
	fresh := func(n int) []uint64 { // n blocks no other sequence has
		out := make([]uint64, n)
		for i := range out {
			next++
			out[i] = next
		}
		return out
	}
	families := [][]uint64{fresh(100 * g), fresh(100 * g), fresh(100 * g)}
	// The positions read: granule j's last block, spanning the blocks
	// from the one before.
	span := map[int]int{}
	last := 0
	for j := 1; j <= 200; j++ {
		if sampledRead(j) {
			span[j*g-1] = (j - last) * g
			last = j
		}
	}
	type live struct {
		blocks []uint64
		tokens int
		read   int   // the blocks up to its last node read
		tail   int64 // the blocks after it
		bound  int64 // what it may be counted over by
	}
	ref := map[string]live{}
	held := map[uint64]int{}    // each live full block: its holds
	sampled := map[uint64]int{} // each node read: its span
	refs := map[uint64]int{}    // and its holds
	count := func(h live, d int) {
		for i, id := range h.blocks {
			if held[id] += d; held[id] == 0 {
				delete(held, id)
			}
			if sp, ok := span[i]; ok {
				sampled[id] = sp
				if refs[id] += d; refs[id] == 0 {
					delete(refs, id)
					delete(sampled, id)
				}
			}
		}
	}
	drop := func(key string) {
		if h, ok := ref[key]; ok {
			count(h, -1)
			delete(ref, key)
		}
	}
	now := t0
	for step := range 600 {
		key := fmt.Sprint("k", rng.IntN(40))
		switch op := rng.IntN(10); {
		case op < 5:
			// A family's prefix or a live hold's (a fork), then its own.
			base := families[rng.IntN(len(families))]
			if op == 4 && len(ref) > 0 {
				for _, h := range ref {
					base = h.blocks
					break
				}
			}
			common := rng.IntN(len(base) + 1)
			blocks := append(slices.Clone(base[:common]), fresh(rng.IntN(20*g+5))...)
			tokens := len(blocks)*bs + rng.IntN(bs)
			if tokens == 0 {
				continue
			}
			h := budget.Hold{Key: key, Engine: "d", Tokens: tokens, Created: now, Expires: now.Add(ttl),
				Saved: time.Second, Prefix: seq(blocks), PrefixBlockSize: bs}
			require.NoError(t, b.Add(h))
			drop(key)
			l := live{blocks: blocks, tokens: tokens}
			read, gap := 0, g // its last node read; the span after it
			for j := 1; j*g <= len(blocks); j++ {
				if sampledRead(j) {
					read = j * g
				}
			}
			for j := read/g + 1; ; j++ {
				if sampledRead(j) {
					gap = j*g - read
					break
				}
			}
			l.read, l.tail = read, int64((tokens+bs-1)/bs-read)
			l.bound = int64(gap - 1)
			ref[key] = l
			count(l, 1)
		case op < 7:
			b.End(key, now)
			drop(key)
		case op < 8:
			b.Return(key, now)
			drop(key)
		default:
			for _, v := range b.Victims("d", rng.IntN(10*50*g*bs), now) {
				_, ok := ref[v.Key]
				require.True(t, ok)
				drop(v.Key)
			}
		}
		want := int64(len(held)) // the engine's distinct blocks
		model := int64(0)        // the nodes read, and the rest
		var over, most int64
		for _, h := range ref {
			want += int64((h.tokens+bs-1)/bs - len(h.blocks))
			model += h.tail
			over += h.bound
			most = max(most, h.bound)
		}
		for _, sp := range sampled {
			model += int64(sp)
		}
		var got int64
		if u := b.Usage(now); len(u) > 0 {
			got = u[0].Blocks
			require.Equal(t, len(ref), u[0].Holds, "step %d", step)
		}
		require.GreaterOrEqual(t, got, want, "step %d: never fewer than the engine's distinct blocks", step)
		require.LessOrEqual(t, got, want+over-most, "step %d: over by less than a node's span a hold", step)
		require.Equal(t, model, got, "step %d", step)
		require.Equal(t, len(sampled), b.Nodes("d"), "step %d", step)
		// What each hold's release would free: the blocks after its last
		// node, and its last nodes no other hold passes through.
		for key, h := range ref {
			own := h.tail
			for i := h.read - 1; i >= 0; i-- {
				if _, ok := span[i]; ok {
					if refs[h.blocks[i]] != 1 {
						break
					}
					own += int64(span[i])
				}
			}
			l, ok := b.Lookup(key)
			require.True(t, ok)
			require.Equal(t, int64(l.Blocks)-own, int64(l.Shared), "step %d: %s", step, key)
		}
		if g == 1 && len(ref) > 0 && most == 0 {
			require.Equal(t, want, got, "step %d: exact where every block is read", step)
		}
		now = now.Add(time.Millisecond)
	}
}
