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
