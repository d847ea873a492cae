package budget_test

import (
	"fmt"
	"iter"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// seq yields hs.
func seq(hs []uint64) iter.Seq[uint64] { return slices.Values(hs) }

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
	// 4 holds of 100 shared and 10 own full blocks: 140 distinct blocks.
	b.SetCapacity("d", budget.Capacity{Tokens: 140 * 16})
	for i := range 4 {
		require.NoError(t, b.Add(prefixHold(fmt.Sprint("k", i), family(100, 110, uint64(1000*(i+1))), 110*16, t0)))
	}
	// A hold of the shared prefix alone: nothing of its own.
	require.NoError(t, b.Add(prefixHold("p", family(100, 100, 0), 100*16, t0)))
	assert.Nil(t, b.Victims("d", 0, t0), "140 distinct blocks fit 140")
	// Room for 15 blocks: two holds' own blocks, not the prefix.
	v := b.Victims("d", 15*16, t0)
	require.Len(t, v, 2)
	for _, x := range v {
		assert.NotEqual(t, "p", x.Key)
		assert.Equal(t, 100, x.Shared)
	}
	assert.EqualValues(t, 120, b.Usage(t0)[0].Blocks)
	// Room for everything: every hold with blocks of its own goes; p
	// frees nothing while k2 and k3 share its blocks, then everything.
	v = b.Victims("d", 140*16, t0)
	var keys []string
	for _, x := range v {
		keys = append(keys, x.Key)
	}
	assert.Len(t, keys, 3)
	assert.Zero(t, b.Usage(t0)[0].Blocks)
}

// The ledger's distinct blocks agree with a plain set of every live
// hold's chained prefixes under random adds, ends, returns and victims.
func TestSharedPrefixRandom(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 1))
	b, err := budget.New(budget.WithBlockSize(16), budget.WithFraction(1))
	require.NoError(t, err)
	b.SetCapacity("d", budget.Capacity{Tokens: 400 * 16})
	type live struct {
		blocks []uint64
		tokens int
	}
	ref := map[string]live{}
	now := t0
	for step := range 800 {
		key := fmt.Sprint("k", rng.IntN(30))
		switch op := rng.IntN(10); {
		case op < 5:
			// A family's prefix (of 3), then blocks of its own.
			fam := uint64(rng.IntN(3)+1) << 32
			common, n := rng.IntN(40), rng.IntN(60)
			var blocks []uint64
			for i := range n {
				if i < common {
					blocks = append(blocks, fam+uint64(i))
				} else {
					blocks = append(blocks, uint64(step)<<40+uint64(i))
				}
			}
			tokens := n*16 + rng.IntN(16)
			if tokens == 0 {
				continue
			}
			require.NoError(t, b.Add(prefixHold(key, blocks, tokens, now)))
			ref[key] = live{blocks, tokens}
		case op < 7:
			b.End(key, now)
			delete(ref, key)
		case op < 8:
			b.Return(key, now)
			delete(ref, key)
		default:
			for _, v := range b.Victims("d", rng.IntN(200*16), now) {
				_, ok := ref[v.Key]
				require.True(t, ok)
				delete(ref, v.Key)
			}
		}
		// Distinct chained prefixes, plus each hold's partial block.
		distinct := map[string]bool{}
		var want int64
		for _, h := range ref {
			for i := range h.blocks {
				distinct[fmt.Sprint(h.blocks[:i+1])] = true
			}
			if h.tokens%16 != 0 {
				want++
			}
		}
		want += int64(len(distinct))
		var got int64
		if u := b.Usage(now); len(u) > 0 {
			got = u[0].Blocks
			require.Equal(t, len(ref), u[0].Holds, "step %d", step)
		}
		require.Equal(t, want, got, "step %d", step)
		now = now.Add(time.Millisecond)
	}
}
