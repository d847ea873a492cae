package budget_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

func TestOptionsInvalid(t *testing.T) {
	cases := []struct {
		opt  budget.Option
		name string
	}{
		{budget.WithFraction(0), "WithFraction"},
		{budget.WithFraction(-0.5), "WithFraction"},
		{budget.WithFraction(1.01), "WithFraction"},
		{budget.WithCapacity(-1), "WithCapacity"},
		{budget.WithBlockSize(0), "WithBlockSize"},
		{budget.WithHorizon(0), "WithHorizon"},
		{budget.WithHorizon(budget.MaxHorizon + time.Second), "WithHorizon"},
		{budget.WithHalfLife(time.Millisecond), "WithHalfLife"},
		{budget.WithMaxClasses(0), "WithMaxClasses"},
		{budget.WithRefresh(0), "WithRefresh"},
	}
	for _, tc := range cases {
		_, err := budget.New(tc.opt)
		require.ErrorIs(t, err, budget.ErrInvalidConfig)
		assert.Contains(t, err.Error(), tc.name)
		assert.Contains(t, err.Error(), "default")
	}
	// The model's own options are checked by NewModel too; a Budget's are
	// refused there.
	_, err := budget.NewModel(budget.WithHalfLife(0))
	assert.ErrorIs(t, err, budget.ErrInvalidConfig)
	_, err = budget.NewModel(budget.WithFraction(0.3))
	require.ErrorIs(t, err, budget.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "WithFraction configures a Budget")
	// In-range values are accepted, the bounds included.
	_, err = budget.New(budget.WithFraction(1), budget.WithCapacity(0), budget.WithHorizon(budget.MaxHorizon), budget.WithHalfLife(time.Second))
	assert.NoError(t, err)
	_, err = budget.NewModel(budget.WithHorizon(time.Minute), budget.WithMaxClasses(1), budget.WithRefresh(time.Millisecond))
	assert.NoError(t, err)
}

func TestAddInvalid(t *testing.T) {
	b, err := budget.New()
	require.NoError(t, err)
	ok := budget.Hold{Key: "k", Engine: "d", Tokens: 10, Created: t0, Expires: t0.Add(ttl)}
	require.NoError(t, b.Add(ok))
	for name, mod := range map[string]func(*budget.Hold){
		"no key":          func(h *budget.Hold) { h.Key = "" },
		"no engine":       func(h *budget.Hold) { h.Engine = "" },
		"no tokens":       func(h *budget.Hold) { h.Tokens = 0 },
		"negative tokens": func(h *budget.Hold) { h.Tokens = -5 },
		"too many tokens": func(h *budget.Hold) { h.Tokens = 1 << 32 },
		"expires at creation": func(h *budget.Hold) {
			h.Expires = h.Created
		},
		"expires before creation": func(h *budget.Hold) { h.Expires = h.Created.Add(-time.Second) },
		"negative saved":          func(h *budget.Hold) { h.Saved = -time.Millisecond },
	} {
		h := ok
		h.Key = "other"
		mod(&h)
		assert.ErrorIs(t, b.Add(h), budget.ErrInvalidHold, name)
	}
	assert.Equal(t, int64(1), b.Stats().Added, "an invalid hold is not recorded")
	_, live := b.Lookup("other")
	assert.False(t, live)
}

// Features without a turn count as a first request; an unknown class
// has the overall figures.
func TestFeaturesDefaults(t *testing.T) {
	m, err := budget.NewModel()
	require.NoError(t, err)
	for i := range 200 {
		c := t0.Add(time.Duration(i) * time.Second)
		m.Observe(budget.Features{Turn: 1}, c, 10*time.Second)
		m.Censor(budget.Features{Turn: 5}, c, time.Hour)
	}
	m.Refresh(t0.Add(time.Hour), func(func(budget.Features, time.Time) bool) {})
	assert.Equal(t, m.Probability(budget.Features{Turn: 1}, 0, ttl), m.Probability(budget.Features{Turn: 0}, 0, ttl))
	assert.Equal(t, m.Probability(budget.Features{Turn: 1}, 0, ttl), m.Probability(budget.Features{Turn: -3, Class: "never seen"}, 0, ttl))
	assert.Greater(t, m.Probability(budget.Features{Turn: 1}, 0, ttl), 0.9)
	assert.Less(t, m.Probability(budget.Features{Turn: 6}, 0, ttl), 0.1)
}

// A Budget handed to a router takes the router's settings where its maker
// left the defaults (Inherit), and keeps those its maker gave.
func TestInherit(t *testing.T) {
	budgetOf := func(b *budget.Budget) int64 {
		_, bud := b.Held("d", t0)
		return bud
	}
	hold := budget.Hold{Key: "k", Engine: "d", Tokens: 10, Created: t0, Expires: t0.Add(ttl)}

	b, err := budget.New()
	require.NoError(t, err)
	require.NoError(t, b.Add(hold))
	assert.False(t, b.Given("WithFraction"))
	require.NoError(t, b.Inherit(budget.WithFraction(0.9), budget.WithCapacity(1000)))
	assert.Equal(t, int64(900), budgetOf(b), "the default fraction (0.5) gives way")
	assert.False(t, b.Given("WithFraction"), "what Inherit gave is not the maker's")
	// A second caller sharing the Budget: the same settings are accepted,
	// other ones fail naming both, and change nothing.
	require.NoError(t, b.Inherit(budget.WithFraction(0.9), budget.WithCapacity(1000)))
	err = b.Inherit(budget.WithCapacity(1000), budget.WithFraction(0.2))
	require.ErrorIs(t, err, budget.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "WithFraction(0.2)")
	assert.Contains(t, err.Error(), "WithFraction(0.9)")
	assert.Equal(t, int64(900), budgetOf(b))
	err = b.Inherit(budget.WithGrace(time.Second), budget.WithCapacity(2000))
	require.ErrorIs(t, err, budget.ErrInvalidConfig)
	assert.Contains(t, err.Error(), "WithCapacity(2000) conflicts with WithCapacity(1000)")
	assert.Equal(t, int64(900), budgetOf(b))
	require.NoError(t, b.Inherit(budget.WithGrace(time.Second)), "the failed Inherit gave no WithGrace")
	require.NoError(t, b.Inherit(budget.WithGrace(time.Second)))
	require.Error(t, b.Inherit(budget.WithGrace(0)))
	value := func(budget.Held, time.Duration, float64) float64 { return 0 }
	require.NoError(t, b.Inherit(budget.WithValue(value)))
	require.NoError(t, b.Inherit(budget.WithValue(value)), "the same function")
	require.Error(t, b.Inherit(budget.WithValue(nil)))

	b, err = budget.New(budget.WithFraction(0.5))
	require.NoError(t, err)
	require.NoError(t, b.Add(hold))
	assert.True(t, b.Given("WithFraction"))
	assert.False(t, b.Given("WithCapacity"))
	require.NoError(t, b.Inherit(budget.WithFraction(0.9), budget.WithCapacity(1000)))
	assert.Equal(t, int64(500), budgetOf(b), "the maker's fraction rules, the capacity is inherited")

	b, err = budget.New()
	require.NoError(t, err)
	require.NoError(t, b.Add(hold))
	for _, opts := range [][]budget.Option{
		{budget.WithCapacity(1000), budget.WithHorizon(time.Minute)}, // a Model option
		{budget.WithCapacity(1000), budget.WithFraction(0)},          // out of range
	} {
		err := b.Inherit(opts...)
		assert.ErrorIs(t, err, budget.ErrInvalidConfig)
		assert.Zero(t, budgetOf(b), "nothing changed")
		assert.False(t, b.Given("WithCapacity"))
	}
}
