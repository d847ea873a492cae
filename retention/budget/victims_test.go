package budget_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

const ttl = 480 * time.Second

type addSpec struct {
	key    string
	tokens int
	age    time.Duration // before now
	saved  time.Duration
	f      budget.Features
}

func keys(vs []budget.Victim) []string {
	var out []string
	for _, v := range vs {
		out = append(out, v.Key)
	}
	return out
}

func TestVictims(t *testing.T) {
	now := t0.Add(time.Hour)
	sec := time.Second
	cases := []struct {
		name     string
		capacity int64 // of "d0"; the budget is half
		holds    []addSpec
		incoming int
		want     []string
	}{
		{"under budget: nothing, however little the holds are worth", 10_000,
			[]addSpec{{"a", 1000, 400 * sec, 0, budget.Features{}}, {"b", 3000, 10 * sec, 0, budget.Features{}}}, 0, nil},
		{"exactly at budget: nothing", 10_000,
			[]addSpec{{"a", 2000, 400 * sec, 0, budget.Features{}}, {"b", 2992, 10 * sec, 0, budget.Features{}}}, 0, nil},
		{"capacity unknown: nothing", 0,
			[]addSpec{{"a", 9000, 400 * sec, 0, budget.Features{}}}, 0, nil},
		{"over: the hold that saves nothing first", 10_000,
			[]addSpec{{"a", 2000, 10 * sec, sec, budget.Features{}}, {"b", 2000, 10 * sec, 0, budget.Features{}}, {"c", 2000, 10 * sec, sec, budget.Features{}}}, 0, []string{"b"}},
		{"over: the one near its expiry first (least chance left)", 10_000,
			[]addSpec{{"a", 2000, 20 * sec, sec, budget.Features{}}, {"b", 2000, 470 * sec, sec, budget.Features{}}, {"c", 2000, 60 * sec, sec, budget.Features{}}}, 0, []string{"b"}},
		{"over: equal values go oldest first", 10_000,
			[]addSpec{{"a", 2000, 20 * sec, 0, budget.Features{}}, {"b", 2000, 30 * sec, 0, budget.Features{}}, {"c", 2000, 10 * sec, 0, budget.Features{}}}, 0, []string{"b"}},
		{"incoming makes room: as many as needed, no more", 10_000,
			[]addSpec{{"a", 1000, 100 * sec, sec, budget.Features{}}, {"b", 1000, 200 * sec, sec, budget.Features{}}, {"c", 1000, 300 * sec, sec, budget.Features{}}}, 3500, []string{"c", "b"}},
		{"counted in whole blocks: 3 holds of 17 tokens take 96", 180,
			[]addSpec{{"a", 17, 100 * sec, sec, budget.Features{}}, {"b", 17, 200 * sec, sec, budget.Features{}}, {"c", 17, 300 * sec, sec, budget.Features{}}}, 0, []string{"c"}},
		{"incoming beyond the budget: everything", 1000,
			[]addSpec{{"a", 100, 100 * sec, sec, budget.Features{}}, {"b", 100, 200 * sec, sec, budget.Features{}}}, 600, []string{"b", "a"}},
		{"a reply that ended in tool calls is kept over a plain one", 10_000,
			[]addSpec{{"plain", 2000, 20 * sec, sec, budget.Features{}}, {"tool", 2000, 20 * sec, sec, budget.Features{ToolCalls: true}}, {"c", 2000, 5 * sec, sec, budget.Features{ToolCalls: true}}}, 0, []string{"plain"}},
		{"more saved per block is kept", 10_000,
			[]addSpec{{"cheap", 2000, 20 * sec, sec, budget.Features{}}, {"dear", 2000, 20 * sec, 3 * sec, budget.Features{}}, {"c", 2000, 20 * sec, 2 * sec, budget.Features{}}}, 0, []string{"cheap"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			b, err := budget.New(budget.WithBlockSize(16))
			require.NoError(t, err)
			b.SetCapacity("d0", budget.Capacity{Tokens: tc.capacity})
			b.SetCapacity("d1", budget.Capacity{Tokens: 100}) // another engine, far over: untouched
			require.NoError(t, b.Add(budget.Hold{Key: "other", Engine: "d1", Tokens: 5000, Created: now.Add(-time.Minute), Expires: now.Add(ttl), Saved: sec}))
			// Holds added oldest first, as time goes.
			sorted := append([]addSpec(nil), tc.holds...)
			for i := range sorted {
				for j := i + 1; j < len(sorted); j++ {
					if sorted[j].age > sorted[i].age {
						sorted[i], sorted[j] = sorted[j], sorted[i]
					}
				}
			}
			for _, h := range sorted {
				c := now.Add(-h.age)
				require.NoError(t, b.Add(budget.Hold{Key: h.key, Engine: "d0", Tokens: h.tokens, Created: c, Expires: c.Add(ttl), Saved: h.saved, Features: h.f}))
			}
			got := b.Victims("d0", tc.incoming, now)
			assert.Equal(t, tc.want, keys(got))
			for _, v := range got {
				assert.False(t, b.Return(v.Key, now), "a victim has left the ledger")
			}
			assert.Equal(t, int64(len(got)), b.Stats().Released)
			assert.Equal(t, int64(len(got)), b.Stats().ReturnedAfterEnd, "a released hold's conversation is still watched")
			assert.Equal(t, 1, b.Usage(now)[1].Holds, "another engine's holds are never chosen")
			assert.Empty(t, b.Victims("d0", tc.incoming, now), "a second call releases nothing more")
		})
	}
}

// The learned model, not only the prior, orders the victims: after seeing
// first requests never come back and later turns always do, a first
// request's hold goes first, whatever its age.
func TestVictimsLearned(t *testing.T) {
	b, err := budget.New(budget.WithCapacity(20_000))
	require.NoError(t, err)
	now := t0
	for i := range 400 {
		k := fmt.Sprint("train-", i)
		f := budget.Features{Turn: 1 + i%2}
		require.NoError(t, b.Add(budget.Hold{Key: k, Engine: "d", Tokens: 10, Created: now, Expires: now.Add(ttl), Features: f, Saved: time.Second}))
		if f.Turn == 2 {
			b.Return(k, now.Add(30*time.Second))
		}
		now = now.Add(5 * time.Second)
	}
	now = now.Add(time.Hour) // every turn-1 hold expired and its horizon passed
	b.Usage(now)
	st := b.Stats()
	assert.Equal(t, int64(200), st.Returned)
	assert.Equal(t, int64(200), st.Expired)
	assert.Equal(t, int64(200), st.Censored)
	assert.Zero(t, st.Holds)
	assert.Zero(t, st.Tombstones)
	require.NoError(t, b.Add(budget.Hold{Key: "second-turn", Engine: "d", Tokens: 4000, Created: now.Add(-30 * time.Second), Expires: now.Add(450 * time.Second), Features: budget.Features{Turn: 2}, Saved: time.Second}))
	require.NoError(t, b.Add(budget.Hold{Key: "first", Engine: "d", Tokens: 4000, Created: now.Add(-time.Second), Expires: now.Add(479 * time.Second), Features: budget.Features{Turn: 1}, Saved: time.Second}))
	require.NoError(t, b.Add(budget.Hold{Key: "fourth", Engine: "d", Tokens: 4000, Created: now, Expires: now.Add(ttl), Features: budget.Features{Turn: 4}, Saved: time.Second}))
	got := b.Victims("d", 0, now)
	assert.Equal(t, []string{"first"}, keys(got))
	assert.Less(t, got[0].Probability, 0.1)
	p := b.Probability(budget.Features{Turn: 2}, 0, ttl, now)
	assert.Greater(t, p, 0.9)
}

// WithValue ranks holds in place of the gap model: what the caller knows
// (here: "b" comes back in a second, "a" never) beats what the model
// predicts (the model alone releases the older "b"), and the function
// sees each hold, its age and the model's value.
func TestVictimsWithValue(t *testing.T) {
	now := t0.Add(time.Hour)
	holds := []addSpec{{"a", 2000, 10 * time.Second, time.Second, budget.Features{}},
		{"b", 2000, 400 * time.Second, time.Second, budget.Features{}}, {"c", 2000, 20 * time.Second, time.Second, budget.Features{}}}
	run := func(opts ...budget.Option) []string {
		b, err := budget.New(append([]budget.Option{budget.WithCapacity(10_000)}, opts...)...)
		require.NoError(t, err)
		for _, h := range holds {
			require.NoError(t, b.Add(budget.Hold{Key: h.key, Engine: "d0", Tokens: h.tokens, Created: now.Add(-h.age),
				Expires: now.Add(-h.age).Add(ttl), Saved: h.saved, Features: h.f}))
		}
		return keys(b.Victims("d0", 0, now))
	}
	require.Equal(t, []string{"b"}, run(), "the gap model releases the hold nearest its expiry")
	seen := map[string]time.Duration{}
	got := run(budget.WithValue(func(h budget.Held, waited time.Duration, model float64) float64 {
		seen[h.Key] = waited
		assert.Positive(t, model)
		assert.Equal(t, 2000, h.Tokens)
		if h.Key == "a" {
			return 0 // its session ended
		}
		return 1
	}))
	assert.Equal(t, []string{"a"}, got)
	assert.Equal(t, map[string]time.Duration{"a": 10 * time.Second, "b": 400 * time.Second, "c": 20 * time.Second}, seen)
	_, err := budget.NewModel(budget.WithValue(nil))
	assert.ErrorIs(t, err, budget.ErrInvalidConfig, "a Model has no value function")
}

// VictimsFor makes room for an owner: of other owners' holds it chooses at
// most the tokens it is given, passing over those that would go beyond,
// and the owner's own holds without limit; each victim says whose it was.
func TestVictimsFor(t *testing.T) {
	now := t0.Add(time.Hour)
	add := func(b *budget.Budget, key, owner string, tokens int, age time.Duration) {
		require.NoError(t, b.Add(budget.Hold{Key: key, Engine: "d0", Tokens: tokens, Created: now.Add(-age),
			Expires: now.Add(-age).Add(ttl), Owner: owner}))
	}
	setup := func() *budget.Budget {
		b, err := budget.New(budget.WithFraction(1))
		require.NoError(t, err)
		b.SetCapacity("d0", budget.Capacity{Tokens: 4000})
		// Oldest first in value (all save nothing): a, b (bob's), c (ann's), d (bob's).
		add(b, "a", "bob", 1000, 400*time.Second)
		add(b, "b", "bob", 1000, 300*time.Second)
		add(b, "c", "ann", 1000, 200*time.Second)
		add(b, "d", "bob", 992, 100*time.Second)
		return b
	}
	for _, tc := range []struct {
		name    string
		others  int64
		want    []string
		other   []bool
		limited bool
	}{
		{"no limit: as Victims", -1, []string{"a", "b", "c"}, []bool{true, true, false}, false},
		{"one of the others' holds, then the owner's own", 1000, []string{"a", "c"}, []bool{true, false}, true},
		{"none of the others'", 0, []string{"c"}, []bool{false}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := setup()
			vs, limited := b.VictimsFor("d0", 2500, "ann", tc.others, now)
			assert.Equal(t, tc.want, keys(vs))
			var other []bool
			for _, v := range vs {
				other = append(other, v.Other)
			}
			assert.Equal(t, tc.other, other)
			assert.Equal(t, tc.limited, limited)
		})
	}
	// Victims marks nothing Other.
	b := setup()
	for _, v := range b.Victims("d0", 2500, now) {
		assert.False(t, v.Other)
	}
}
