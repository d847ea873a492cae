package budget_test

import (
	"fmt"
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
// prompt, forks of live holds), at block sizes whose granule is 16, 5, 4
// and 1 blocks: never fewer than the engine's distinct blocks (a plain
// set of every live hold's block hashes, chained), never more than those
// plus granule-1 blocks per hold after the first, and exactly the sampled
// count link describes; its nodes are the distinct sampled blocks.
func TestSharedPrefixSampledBounds(t *testing.T) {
	for _, bs := range []int{16, 48, 64, 256} {
		t.Run(fmt.Sprint(bs), func(t *testing.T) { sampledBounds(t, bs) })
	}
}

func sampledBounds(t *testing.T, bs int) {
	g := max(1, budget.PrefixGranule/bs)
	rng := rand.New(rand.NewPCG(3, uint64(bs)))
	b, err := budget.New(budget.WithBlockSize(bs), budget.WithFraction(1))
	require.NoError(t, err)
	b.SetCapacity("d", budget.Capacity{Tokens: int64(600 * bs)})
	next := uint64(0)
	fresh := func(n int) []uint64 { // n blocks no other sequence has
		out := make([]uint64, n)
		for i := range out {
			next++
			out[i] = next
		}
		return out
	}
	families := [][]uint64{fresh(200), fresh(200), fresh(200)}
	type live struct {
		blocks []uint64
		tokens int
	}
	ref := map[string]live{}
	now := t0
	for step := range 1500 {
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
			common := rng.IntN(min(len(base), 3*g+30) + 1)
			blocks := append(slices.Clone(base[:common]), fresh(rng.IntN(4*g+20))...)
			tokens := len(blocks)*bs + rng.IntN(bs)
			if tokens == 0 {
				continue
			}
			h := budget.Hold{Key: key, Engine: "d", Tokens: tokens, Created: now, Expires: now.Add(ttl),
				Saved: time.Second, Prefix: seq(blocks), PrefixBlockSize: bs}
			require.NoError(t, b.Add(h))
			ref[key] = live{blocks, tokens}
		case op < 7:
			b.End(key, now)
			delete(ref, key)
		case op < 8:
			b.Return(key, now)
			delete(ref, key)
		default:
			for _, v := range b.Victims("d", rng.IntN(300*bs), now) {
				_, ok := ref[v.Key]
				require.True(t, ok)
				delete(ref, v.Key)
			}
		}
		// The engine's distinct blocks (each hold's partial one its own),
		// and the sampled count: a node per distinct granule end, the rest
		// of each hold its own.
		distinct, sampled := map[uint64]bool{}, map[uint64]bool{}
		var want, model int64
		for _, h := range ref {
			for i, id := range h.blocks {
				distinct[id] = true
				if (i+1)%g == 0 {
					sampled[id] = true
				}
			}
			all := int64((h.tokens + bs - 1) / bs)
			want += all - int64(len(h.blocks))
			model += all - int64(len(h.blocks)/g*g)
		}
		want += int64(len(distinct))
		model += int64(len(sampled) * g)
		var got int64
		if u := b.Usage(now); len(u) > 0 {
			got = u[0].Blocks
			require.Equal(t, len(ref), u[0].Holds, "step %d", step)
		}
		require.GreaterOrEqual(t, got, want, "step %d: never fewer than the engine's distinct blocks", step)
		require.LessOrEqual(t, got, want+int64((g-1)*max(len(ref)-1, 0)), "step %d: over by less than a granule a hold", step)
		require.Equal(t, model, got, "step %d", step)
		require.Equal(t, len(sampled), b.Nodes("d"), "step %d", step)
		if g == 1 {
			require.Equal(t, want, got, "step %d: exact at a granule of one block", step)
		}
		now = now.Add(time.Millisecond)
	}
}
