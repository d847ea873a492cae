package budget_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// Prefilled names the prefill engine SetPrefilled recorded for a hold's
// turn once Victims released the hold, until the horizon: nothing for a
// hold still live, attached (returned) or expired, nor for a key never
// recorded; a later turn's record under the key starts unreleased.
func TestPrefilled(t *testing.T) {
	b, err := budget.New(budget.WithHorizon(10*time.Minute), budget.WithFraction(1))
	require.NoError(t, err)
	b.SetCapacity("d", budget.Capacity{Tokens: 4000})
	now := t0
	add := func(key string, tokens int, age time.Duration, p string) {
		c := now.Add(-age)
		require.NoError(t, b.Add(budget.Hold{Key: key, Engine: "d", Tokens: tokens, Created: c, Expires: c.Add(ttl), Saved: time.Second}))
		b.SetPrefilled(key, p, now)
	}
	add("old", 1000, 400*time.Second, "http://p0") // least chance left: the victim
	add("new", 1000, time.Second, "http://p1")
	add("back", 1000, time.Second, "http://p1")
	b.SetPrefilled("", "http://p1", now)
	b.SetPrefilled("none", "", now)
	assert.Empty(t, b.Prefilled("old", now), "not released yet")
	assert.True(t, b.Return("back", now.Add(time.Second)))
	assert.Equal(t, []string{"old"}, keys(b.Victims("d", 2500, now)))
	later := now.Add(time.Minute)
	assert.Equal(t, "http://p0", b.Prefilled("old", later))
	assert.Empty(t, b.Prefilled("new", later), "live")
	assert.Empty(t, b.Prefilled("back", later), "attached")
	assert.Empty(t, b.Prefilled("none", later))
	assert.Empty(t, b.Prefilled("unknown", later))
	assert.Empty(t, b.Prefilled("new", now.Add(ttl+time.Second)), "expired, not released")
	assert.Empty(t, b.Prefilled("old", now.Add(10*time.Minute)), "past the horizon")

	add("old", 1000, 0, "http://p1") // the conversation's next turn retained under the key
	assert.Empty(t, b.Prefilled("old", later), "a later turn's record is not released")
	for i := range 3000 { // records past the horizon are forgotten as time goes
		b.SetPrefilled(time.Duration(i).String(), "http://p0", now.Add(time.Duration(i)*time.Second))
	}
}

// Placed returns a turn's placement and the tokens the later turns on its
// decode engine touched in its CPU tier (the LRU stack distance): every
// later turn there counts, whether its tokens were new to the tier or
// touched again; another engine's do not; a conversation's turns count
// once, at the latest (Prior); a record keeps its prefill engine for
// Prefilled; nothing is returned past the horizon or for a record without
// engines.
func TestPlaced(t *testing.T) {
	b, err := budget.New(budget.WithHorizon(10*time.Minute), budget.WithFraction(1))
	require.NoError(t, err)
	now := t0
	b.SetPlaced("a", budget.Placement{Prefill: "http://p0", Decode: "http://d0", Tokens: 3000}, now)
	b.SetPlaced("b1", budget.Placement{Decode: "http://d0", Tokens: 5000}, now)
	b.SetPlaced("c", budget.Placement{Prefill: "http://p1", Decode: "http://d1", Tokens: 9000}, now)
	b.SetPlaced("none", budget.Placement{Tokens: 10}, now)
	p, after, ok := b.Placed("a", now)
	require.True(t, ok)
	assert.Equal(t, budget.Placement{Prefill: "http://p0", Decode: "http://d0", Tokens: 3000}, p)
	assert.EqualValues(t, 5000, after, "b1's turn on d0 came after a's; c's on d1 does not count")
	_, after, ok = b.Placed("b1", now)
	assert.True(t, ok)
	assert.Zero(t, after)
	_, _, ok = b.Placed("none", now)
	assert.False(t, ok)

	// b's next turn on d0 touches b1's 5,000 tokens again and adds 1,000:
	// they count once, at b2's place.
	b.SetPlaced("b2", budget.Placement{Decode: "http://d0", Tokens: 6000, Prior: "b1"}, now)
	_, after, _ = b.Placed("a", now)
	assert.EqualValues(t, 6000, after, "b's history counted once")
	// Without Prior (its previous turn was on another engine, or unknown)
	// a turn counts whole.
	b.SetPlaced("x", budget.Placement{Decode: "http://d0", Tokens: 2000, Prior: "c"}, now)
	_, after, _ = b.Placed("a", now)
	assert.EqualValues(t, 8000, after, "c ran on d1: nothing on d0 superseded")

	// A record's turn retained again starts a new age.
	b.SetPlaced("a", budget.Placement{Decode: "http://d0", Tokens: 3500}, now)
	_, after, _ = b.Placed("a", now)
	assert.Zero(t, after)
	_, after, _ = b.Placed("x", now)
	assert.EqualValues(t, 3500, after)

	// With the tier's capacity known, the count stops once past it.
	b.SetCPUTier(4000)
	_, after, _ = b.Placed("b2", now)
	assert.EqualValues(t, 5500, after, "a then x: 3,500 + 2,000, past 4,000")
	_, _, ok = b.Placed("a", now.Add(11*time.Minute))
	assert.False(t, ok, "past the horizon")
}

// With a CPU tier (SetCPUTier), Victims releases first the hold whose
// turn the tier is estimated to hold (demoted, not dropped), before an
// equal hold whose turn the tier has evicted; without a tier, the order is
// the holds' value alone.
func TestVictimsDemoteFirst(t *testing.T) {
	for _, tier := range []int{0, 20000} {
		b, err := budget.New(budget.WithFraction(1))
		require.NoError(t, err)
		b.SetCapacity("d", budget.Capacity{Tokens: 4000})
		b.SetCPUTier(tier)
		now := t0
		for _, k := range []string{"evicted", "kept"} {
			require.NoError(t, b.Add(budget.Hold{Key: k, Engine: "d", Tokens: 1000, Created: now, Expires: now.Add(ttl), Saved: time.Second}))
		}
		// evicted's turn ran first, then 25,000 tokens touched later
		// (kept's and others') pushed it out of a 20,000-token tier.
		b.SetPlaced("evicted", budget.Placement{Decode: "d", Tokens: 1000}, now)
		b.SetPlaced("other", budget.Placement{Decode: "d", Tokens: 24000}, now)
		b.SetPlaced("kept", budget.Placement{Decode: "d", Tokens: 1000}, now)
		got := keys(b.Victims("d", 2500, now))
		if tier == 0 {
			assert.Len(t, got, 1)
			continue
		}
		assert.Equal(t, []string{"kept"}, got, "the hold the tier holds goes first")
	}
}

// Resident is what of a turn a least-recently-used tier still holds after
// the tokens written since: its head, in whole blocks.
func TestPlacementResident(t *testing.T) {
	p := budget.Placement{Decode: "d", Tokens: 10000}
	assert.Equal(t, 10000, p.Resident(50000, 0, 16))
	assert.Equal(t, 10000, p.Resident(50000, 40000, 16), "exactly fits")
	assert.Equal(t, 4992, p.Resident(50000, 45000, 16), "the head survives, in whole blocks")
	assert.Zero(t, p.Resident(50000, 50000, 16))
	assert.Zero(t, p.Resident(0, 0, 16), "no tier")
	assert.Zero(t, budget.Placement{Tokens: 100}.Resident(50000, 0, 16), "no decode engine")
}
