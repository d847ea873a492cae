package budget_test

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// refHold is the reference model's record of a live hold.
type refHold struct {
	engine           string
	tokens, blocks   int
	created, expires time.Time
}

// ledgerRun drives a Budget and a plain map with the same operations read
// from next (which returns a number in [0, n)), and checks after each that
// they agree and that Victims keeps its promises.
func ledgerRun(t *testing.T, next func(n int) int, steps int) {
	const bs = 16
	engines := []string{"d0", "d1", "d2"}
	caps := map[string]int64{"d0": 20_000, "d1": 0, "d2": 5_000} // d1: unknown
	b, err := budget.New(budget.WithFraction(0.5), budget.WithBlockSize(bs))
	require.NoError(t, err)
	for e, c := range caps {
		b.SetCapacity(e, budget.Capacity{Tokens: c})
	}
	ref := map[string]refHold{}
	now := t0
	expire := func() {
		for k, h := range ref {
			if !h.expires.After(now) {
				delete(ref, k)
			}
		}
	}
	held := func(e string) (n int, tok, blocks int64) {
		for _, h := range ref {
			if h.engine == e {
				n++
				tok += int64(h.tokens)
				blocks += int64(h.blocks)
			}
		}
		return
	}
	for step := range steps {
		key := fmt.Sprintf("conv-%d", next(40))
		eng := engines[next(len(engines))]
		var what string
		switch op := next(10); {
		case op < 4:
			tokens := 1 + next(4000)
			ttl := time.Duration(1+next(600)) * time.Second
			f := budget.Features{Class: []string{"", "a", "b"}[next(3)], Turn: next(12), ToolCalls: next(4) == 0}
			h := budget.Hold{Key: key, Engine: eng, Tokens: tokens, Created: now, Expires: now.Add(ttl), Features: f,
				Saved: time.Duration(next(1000)) * time.Millisecond}
			what = fmt.Sprintf("Add(%s, %s, %d, ttl %v)", key, eng, tokens, ttl)
			require.NoError(t, b.Add(h), what)
			expire()
			ref[key] = refHold{engine: eng, tokens: tokens, blocks: (tokens + bs - 1) / bs, created: now, expires: h.Expires}
		case op < 5:
			what = "Return(" + key + ")"
			got := b.Return(key, now)
			expire()
			_, want := ref[key]
			require.Equal(t, want, got, what)
			delete(ref, key)
		case op < 6:
			what = "End(" + key + ")"
			got := b.End(key, now)
			expire()
			_, want := ref[key]
			require.Equal(t, want, got, what)
			delete(ref, key)
		case op < 8:
			incoming := next(3000)
			what = fmt.Sprintf("Victims(%s, %d)", eng, incoming)
			vs := b.Victims(eng, incoming, now)
			expire()
			_, _, blocks := held(eng)
			budgetTok := int64(float64(caps[eng]) * 0.5)
			need := (blocks+int64((incoming+bs-1)/bs))*bs - budgetTok
			if caps[eng] == 0 || need <= 0 {
				require.Empty(t, vs, "%s: under budget or no capacity: nothing released", what)
				break
			}
			freed := int64(0)
			for i, v := range vs {
				h, ok := ref[v.Key]
				require.True(t, ok, "%s: victim %s is live", what, v.Key)
				require.Equal(t, eng, h.engine, "%s: victim on its engine", what)
				require.Equal(t, h.tokens, v.Tokens)
				require.Equal(t, h.blocks, v.Blocks)
				if i > 0 {
					require.LessOrEqual(t, vs[i-1].Value, v.Value, "%s: least value first", what)
				}
				freed += int64(v.Blocks) * bs
				delete(ref, v.Key)
			}
			n, _, _ := held(eng)
			if freed < need {
				require.Zero(t, n, "%s: short of need only when every hold went", what)
			} else {
				last := vs[len(vs)-1]
				require.Less(t, freed-int64(last.Blocks)*bs, need, "%s: no more released than needed", what)
			}
		default:
			d := time.Duration(next(90)) * time.Second
			what = fmt.Sprintf("advance %v", d)
			now = now.Add(d)
			expire()
		}
		us := b.Usage(now)
		for _, u := range us {
			n, tok, blocks := held(u.Engine)
			require.Equal(t, n, u.Holds, "step %d %s: %s holds", step, what, u.Engine)
			require.Equal(t, tok, u.Tokens, "step %d %s: %s tokens", step, what, u.Engine)
			require.Equal(t, blocks, u.Blocks, "step %d %s: %s blocks", step, what, u.Engine)
			require.Equal(t, blocks*bs, u.HeldTokens)
			h, bud := b.Held(u.Engine, now)
			require.Equal(t, u.HeldTokens, h, "step %d %s: Held(%s)", step, what, u.Engine)
			require.Equal(t, u.Budget, bud)
			require.Equal(t, int64(float64(caps[u.Engine])*0.5), bud)
			ages := 0
			for _, a := range u.Ages {
				ages += a
			}
			require.Equal(t, n, ages)
		}
		require.Equal(t, len(ref), b.Stats().Holds, "step %d %s", step, what)
		for i := range 40 {
			k := fmt.Sprintf("conv-%d", i)
			got, ok := b.Lookup(k)
			want, live := ref[k]
			require.Equal(t, live, ok, "step %d %s: Lookup(%s)", step, what, k)
			if live {
				require.Equal(t, budget.Held{Key: k, Engine: want.engine, Tokens: want.tokens, Blocks: want.blocks,
					Created: want.created.UTC(), Expires: want.expires.UTC()}, budget.Held{Key: got.Key, Engine: got.Engine,
					Tokens: got.Tokens, Blocks: got.Blocks, Created: got.Created.UTC(), Expires: got.Expires.UTC()})
			}
		}
	}
	// Whatever happened, every probability stays in [0, 1].
	s := b.Snapshot(now, 480*time.Second)
	for _, c := range s.Classes {
		require.True(t, c.Return >= 0 && c.Return <= 1)
		for _, w := range c.Within {
			require.True(t, w.Probability >= 0 && w.Probability <= 1)
		}
	}
}

func TestLedgerAgainstModel(t *testing.T) {
	for seed := range uint64(60) {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			r := rand.New(rand.NewPCG(seed, 99))
			ledgerRun(t, r.IntN, 400)
		})
	}
}

func FuzzLedger(f *testing.F) {
	f.Add([]byte{0, 1, 2, 3, 4, 5, 6, 7, 8, 9})
	f.Add(slices.Repeat([]byte{7, 0, 200, 3, 9, 1, 50, 6, 2, 255}, 30))
	f.Fuzz(func(t *testing.T, data []byte) {
		next := func(n int) int {
			if len(data) < 2 {
				return 0
			}
			v := int(binary.LittleEndian.Uint16(data))
			data = data[2:]
			return v % n
		}
		ledgerRun(t, next, min(len(data)/8+1, 128)) // a long input is one more run of 128 steps, not a slow one
	})
}

// Capacity reports an engine's capacity as the ledger knows it: its own
// (SetCapacity), else WithCapacity's, else 0.
func TestCapacity(t *testing.T) {
	b, err := budget.New()
	require.NoError(t, err)
	require.Zero(t, b.Capacity("d0"))
	b.SetCapacity("d0", budget.Capacity{Tokens: 4096})
	require.EqualValues(t, 4096, b.Capacity("d0"))
	require.Zero(t, b.Capacity("d1"))
	c, err := budget.New(budget.WithCapacity(1000))
	require.NoError(t, err)
	require.EqualValues(t, 1000, c.Capacity("never-seen"))
	c.SetCapacity("d0", budget.Capacity{Tokens: 2000})
	require.EqualValues(t, 2000, c.Capacity("d0"))
	c.SetCapacity("d0", budget.Capacity{})
	require.EqualValues(t, 1000, c.Capacity("d0"), "unknown again: the option's")
}

// WithGrace: a hold past its Expires stays counted for the grace, while
// its engine still pins it; Expired hands it to the caller once and ends
// it; one nobody releases ends at the grace's end; either way it is
// observed as a hold that ended at its Expires.
func TestGraceKeepsOverdueHolds(t *testing.T) {
	const ttl, grace = 450 * time.Second, 30 * time.Second
	b, err := budget.New(budget.WithGrace(grace), budget.WithCapacity(10_000))
	require.NoError(t, err)
	add := func(key string, at time.Time) {
		require.NoError(t, b.Add(budget.Hold{Key: key, Engine: "d", Tokens: 32, Created: at, Expires: at.Add(ttl), Saved: time.Millisecond}))
	}
	add("a", t0)
	add("b", t0.Add(time.Second))
	add("c", t0.Add(time.Minute))
	at := t0.Add(ttl + 2*time.Second)
	held, _ := b.Held("d", at)
	require.EqualValues(t, 3*32, held, "past their Expires, a and b are still counted")
	got := b.Expired("d", at)
	require.Len(t, got, 2)
	require.ElementsMatch(t, []string{"a", "b"}, []string{got[0].Key, got[1].Key})
	require.Empty(t, b.Expired("d", at), "handed out once")
	held, _ = b.Held("d", at)
	require.EqualValues(t, 32, held)
	require.False(t, b.Return("a", at), "a returning turn finds it ended")
	s := b.Stats()
	require.EqualValues(t, 2, s.Expired)
	require.EqualValues(t, 1, s.ReturnedAfterEnd)
	// c is never handed out: it ends at its Expires plus the grace.
	held, _ = b.Held("d", t0.Add(time.Minute+ttl+grace-time.Second))
	require.EqualValues(t, 32, held)
	held, _ = b.Held("d", t0.Add(time.Minute+ttl+grace))
	require.Zero(t, held)
	require.EqualValues(t, 3, b.Stats().Expired)

	_, err = budget.New(budget.WithGrace(-time.Second))
	require.ErrorIs(t, err, budget.ErrInvalidConfig)
}
