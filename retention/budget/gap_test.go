package budget_test

import (
	"iter"
	"math"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// mixture is a known gap distribution: with probability quick a return
// after an exponential gap of mean quickMean, with probability slow a
// return after a log-normal gap of median slowMedian (sigma 1), else
// never.
type mixture struct {
	quick, slow           float64
	quickMean, slowMedian float64 // seconds
}

func (m mixture) draw(r *rand.Rand) (float64, bool) {
	u := r.Float64()
	switch {
	case u < m.quick:
		return r.ExpFloat64() * m.quickMean, true
	case u < m.quick+m.slow:
		return m.slowMedian * math.Exp(r.NormFloat64()), true
	}
	return 0, false
}

// cdf is P(return by t seconds).
func (m mixture) cdf(t float64) float64 {
	if t <= 0 {
		return 0
	}
	q := 1 - math.Exp(-t/m.quickMean)
	s := 0.5 * math.Erfc(-math.Log(t/m.slowMedian)/math.Sqrt2)
	return m.quick*q + m.slow*s
}

// cond is P(return in (w, u] | none by w).
func (m mixture) cond(w, u float64) float64 {
	return (m.cdf(u) - m.cdf(w)) / (1 - m.cdf(w))
}

type obs struct {
	f       budget.Features
	created time.Time
	gap     float64 // seconds; the return's gap, or +Inf
	watch   float64 // seconds watched before giving up
}

// feed replays observations created one every step against the model as
// an online caller would: at each refresh time it closes what has
// returned or been given up by then and passes the rest as open.
func feed(t *testing.T, m *budget.Model, all []obs, step time.Duration) time.Time {
	t.Helper()
	type pending struct {
		o    obs
		done bool
	}
	ps := make([]pending, len(all))
	for i := range all {
		ps[i].o = all[i]
	}
	end := all[len(all)-1].created.Add(time.Minute)
	first := 0
	for now := all[0].created; !now.After(end); now = now.Add(10 * time.Second) {
		for i := first; i < len(ps) && !ps[i].o.created.After(now); i++ {
			p := &ps[i]
			if p.done {
				continue
			}
			age := now.Sub(p.o.created).Seconds()
			switch {
			case p.o.gap <= p.o.watch && p.o.gap <= age:
				m.Observe(p.o.f, p.o.created, time.Duration(p.o.gap*float64(time.Second)))
				p.done = true
			case p.o.gap > p.o.watch && p.o.watch <= age:
				m.Censor(p.o.f, p.o.created, time.Duration(p.o.watch*float64(time.Second)))
				p.done = true
			}
		}
		for first < len(ps) && ps[first].done {
			first++
		}
		var open iter.Seq2[budget.Features, time.Time] = func(yield func(budget.Features, time.Time) bool) {
			for i := first; i < len(ps) && !ps[i].o.created.After(now); i++ {
				if !ps[i].done && !yield(ps[i].o.f, ps[i].o.created) {
					return
				}
			}
		}
		m.Refresh(now, open)
	}
	return end
}

func draws(r *rand.Rand, mx mixture, f budget.Features, n int, start time.Time, step time.Duration, watch func(*rand.Rand) float64) []obs {
	out := make([]obs, n)
	for i := range out {
		g, ok := mx.draw(r)
		if !ok {
			g = math.Inf(1)
		}
		out[i] = obs{f: f, created: start.Add(time.Duration(i) * step), gap: g, watch: watch(r)}
	}
	return out
}

func secs(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func TestModelLearnsMixture(t *testing.T) {
	mx := mixture{quick: 0.25, slow: 0.25, quickMean: 20, slowMedian: 300}
	horizon := func(*rand.Rand) float64 { return 1800 }
	cases := []struct {
		name  string
		watch func(*rand.Rand) float64
	}{
		{"censored at the horizon only", horizon},
		// Holds released or expired at random and never watched after:
		// censoring anywhere, which the survival estimate must undo.
		{"censored uniformly in 0-1800 s", func(r *rand.Rand) float64 { return r.Float64() * 1800 }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			m, err := budget.NewModel(budget.WithHalfLife(100 * time.Hour))
			require.NoError(t, err)
			r := rand.New(rand.NewPCG(1, 2))
			all := draws(r, mx, budget.Features{Class: "acme/qwen"}, 20000, t0, 500*time.Millisecond, tc.watch)
			feed(t, m, all, 500*time.Millisecond)
			f := budget.Features{Class: "acme/qwen"}
			for _, c := range []struct{ w, u float64 }{{0, 10}, {0, 60}, {0, 480}, {60, 480}, {300, 480}, {0, 1500}} {
				want := mx.cond(c.w, c.u)
				got := m.Probability(f, secs(c.w), secs(c.u))
				assert.InDelta(t, want, got, 0.03, "P(return in (%v, %v] s | waited)", c.w, c.u)
			}
			s := m.Snapshot(480 * time.Second)
			require.Len(t, s.Classes, 2)
			assert.InDelta(t, mx.cdf(1800), s.Classes[1].Return, 0.03)
			// The median gap among returns within the horizon.
			med := s.Classes[1].P50.Seconds()
			assert.InDelta(t, mx.cdf(med)/mx.cdf(1800), 0.5, 0.03, "P50 %v", s.Classes[1].P50)
		})
	}
}

// Quick returns close their observations at once, the others only at the
// horizon: counting the open ones as waiting keeps the estimate honest
// while they are open.
func TestModelOpenObservationsNotBiased(t *testing.T) {
	mx := mixture{quick: 0.2, slow: 0.0001, quickMean: 10, slowMedian: 300}
	m, err := budget.NewModel(budget.WithHalfLife(100 * time.Hour))
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(3, 4))
	// 15 minutes of turns, watched for 30: at the end most of those that
	// will never return are still open.
	all := draws(r, mx, budget.Features{}, 1800, t0, 500*time.Millisecond, func(*rand.Rand) float64 { return 1800 })
	feed(t, m, all, 500*time.Millisecond)
	assert.InDelta(t, mx.cond(0, 480), m.Probability(budget.Features{}, 0, 480*time.Second), 0.03)
}

func TestModelConditionsOnFeatures(t *testing.T) {
	type group struct {
		f  budget.Features
		mx mixture
	}
	groups := []group{
		{budget.Features{Turn: 1}, mixture{quick: 0.1, slow: 0.12, quickMean: 60, slowMedian: 200}},
		{budget.Features{Turn: 3}, mixture{quick: 0.2, slow: 0.25, quickMean: 60, slowMedian: 200}},
		{budget.Features{Turn: 2, ToolCalls: true}, mixture{quick: 0.9, slow: 0.05, quickMean: 3, slowMedian: 200}},
	}
	m, err := budget.NewModel(budget.WithHalfLife(100 * time.Hour))
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(5, 6))
	var all []obs
	for i := range 24000 {
		g := groups[i%len(groups)]
		o := draws(r, g.mx, g.f, 1, t0.Add(time.Duration(i)*250*time.Millisecond), 0, func(*rand.Rand) float64 { return 1800 })
		all = append(all, o...)
	}
	feed(t, m, all, 250*time.Millisecond)
	for _, g := range groups {
		assert.InDelta(t, g.mx.cond(0, 480), m.Probability(g.f, 0, 480*time.Second), 0.03, "%+v", g.f)
		assert.InDelta(t, g.mx.cond(0, 10), m.Probability(g.f, 0, 10*time.Second), 0.03, "%+v", g.f)
	}
	s := m.Snapshot(480 * time.Second)
	byGroup := map[[2]int]budget.FeatureSnapshot{}
	for _, w := range s.Classes[0].Within {
		byGroup[[2]int{w.FirstTurn, map[bool]int{false: 0, true: 1}[w.ToolCalls]}] = w
	}
	assert.InDelta(t, groups[0].mx.cdf(480), byGroup[[2]int{1, 0}].Probability, 0.03)
	assert.InDelta(t, groups[1].mx.cdf(480), byGroup[[2]int{3, 0}].Probability, 0.03)
	assert.Equal(t, 4, byGroup[[2]int{3, 0}].LastTurn)
	assert.InDelta(t, groups[2].mx.cdf(480), byGroup[[2]int{2, 1}].Probability, 0.03)
}

// A class seen a few times follows the overall figures; one seen often
// follows its own.
func TestModelClassFallsBackToOverall(t *testing.T) {
	common := mixture{quick: 0.3, slow: 0.2, quickMean: 30, slowMedian: 300}
	rare := mixture{quick: 0.02, slow: 0.02, quickMean: 30, slowMedian: 300}
	m, err := budget.NewModel(budget.WithHalfLife(100 * time.Hour))
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(7, 8))
	var all []obs
	for i := range 10000 {
		f, mx := budget.Features{Class: "big"}, common
		if i%2000 == 0 { // five observations of the rare class
			f, mx = budget.Features{Class: "rare"}, rare
		}
		all = append(all, draws(r, mx, f, 1, t0.Add(time.Duration(i)*time.Second), 0, func(*rand.Rand) float64 { return 1800 })...)
	}
	feed(t, m, all, time.Second)
	big := m.Probability(budget.Features{Class: "big"}, 0, 480*time.Second)
	assert.InDelta(t, common.cdf(480), big, 0.03)
	// Five observations move the rare class only part of the way.
	got := m.Probability(budget.Features{Class: "rare"}, 0, 480*time.Second)
	assert.Greater(t, got, rare.cdf(480)+0.1, "five observations are not enough to leave the overall figures")
	// A class never seen gets the overall figures.
	assert.InDelta(t, big, m.Probability(budget.Features{Class: "unseen"}, 0, 480*time.Second), 0.01)
}

// Recent behaviour wins: after users change their habits, the model
// follows within a few half-lives.
func TestModelDecay(t *testing.T) {
	before := mixture{quick: 0.4, slow: 0.3, quickMean: 30, slowMedian: 200}
	after := mixture{quick: 0.05, slow: 0.05, quickMean: 30, slowMedian: 200}
	m, err := budget.NewModel(budget.WithHalfLife(10 * time.Minute))
	require.NoError(t, err)
	r := rand.New(rand.NewPCG(9, 10))
	watch := func(*rand.Rand) float64 { return 1800 }
	all := draws(r, before, budget.Features{}, 7200, t0, time.Second, watch)
	all = append(all, draws(r, after, budget.Features{}, 7200, t0.Add(2*time.Hour), time.Second, watch)...)
	feed(t, m, all, time.Second)
	assert.InDelta(t, after.cdf(480), m.Probability(budget.Features{}, 0, 480*time.Second), 0.05)
}

func TestModelPriorBeforeObservations(t *testing.T) {
	m, err := budget.NewModel()
	require.NoError(t, err)
	// Tool calls come back sooner than plain replies.
	tool := m.Probability(budget.Features{ToolCalls: true}, 0, 30*time.Second)
	plain := m.Probability(budget.Features{}, 0, 30*time.Second)
	assert.Greater(t, tool, 2*plain)
	assert.Zero(t, m.Probability(budget.Features{}, time.Minute, time.Minute))
	for _, w := range []time.Duration{0, time.Second, time.Minute, time.Hour, 10 * time.Hour} {
		p := m.Probability(budget.Features{}, w, w+8*time.Minute)
		assert.True(t, p >= 0 && p <= 1, "%v: %v", w, p)
	}
}
