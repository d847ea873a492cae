package budget

import (
	"math"
	"slices"
	"time"
)

// Snapshot is what a [Model] has learned, for metrics: per class and
// overall, the quantiles of the pause before the next turn and the chance
// that a next turn comes, by turn group and tool calls.
type Snapshot struct {
	// At is the time of the refresh the figures come from (zero before
	// the first).
	At time.Time
	// Window is the time within which Within reports the chance of a
	// next turn.
	Window time.Duration
	// Horizon is how long a conversation is watched for its next turn
	// ([WithHorizon]): Return and the quantiles are within it.
	Horizon time.Duration
	// Classes are the overall figures (Class "") first, then each class
	// learned separately, by name.
	Classes []ClassSnapshot
}

// ClassSnapshot is the model of one class, or overall.
type ClassSnapshot struct {
	// Class is the class, "" for the figures over every class.
	Class string
	// Observations counts the closed observations (a next turn, or none
	// within the horizon), each weighted by its age with the half-life.
	Observations float64
	// Returns counts those that were a next turn, weighted alike.
	Returns float64
	// Open counts the observations still open at the refresh, weighted.
	Open float64
	// Return is the chance of a next turn within the horizon.
	Return float64
	// P50, P90 and P99 are quantiles of the gap among the conversations
	// that come back within the horizon.
	P50, P90, P99 time.Duration
	// Within is the chance of a next turn within the snapshot's Window, by
	// turn group and tool calls.
	Within []FeatureSnapshot
}

// FeatureSnapshot is the chance of a next turn within a window for one
// turn group, with or without tool calls.
type FeatureSnapshot struct {
	// FirstTurn and LastTurn bound the turn group (LastTurn 0: no bound).
	FirstTurn, LastTurn int
	// ToolCalls is whether the reply ended in tool calls.
	ToolCalls bool
	// Observations counts the closed and open observations, weighted.
	Observations float64
	// Probability is the chance of a next turn within the window.
	Probability float64
}

// Snapshot reports what the model has learned as of its last refresh, with
// the chance of a next turn within window.
func (m *Model) Snapshot(window time.Duration) Snapshot {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.snapshot(window)
}

// snapshot is Snapshot; m.mu held.
func (m *Model) snapshot(window time.Duration) Snapshot {
	s := Snapshot{Window: window, Horizon: m.cfg.horizon}
	if m.fresh {
		s.At = time.Unix(0, m.at)
	}
	s.Classes = append(s.Classes, m.classSnapshot("", toolCells, window))
	names := slices.Clone(m.names)
	slices.Sort(names)
	for _, n := range names {
		s.Classes = append(s.Classes, m.classSnapshot(n, firstClass+int(m.classes[n])*groupCells, window))
	}
	return s
}

// classSnapshot summarises the groupCells cells from base on.
func (m *Model) classSnapshot(name string, base int, window time.Duration) ClassSnapshot {
	cs := ClassSnapshot{Class: name}
	cells := m.cells[base : base+groupCells]
	weights := make([]float64, len(cells))
	total := 0.0
	for i := range cells {
		c := &cells[i]
		cs.Observations += c.now
		cs.Open += c.open
		weights[i] = c.now + c.open
		total += weights[i]
		g := i / 2
		last := firstTurn[g+1] - 1
		if g == nTurnGroups-1 {
			last = 0
		}
		cs.Within = append(cs.Within, FeatureSnapshot{
			FirstTurn: firstTurn[g], LastTurn: last, ToolCalls: i%2 == 1,
			Observations: weights[i],
			Probability:  1 - survAt(&c.surv, seconds(window)),
		})
		if m.fresh {
			cs.Returns += c.ret * math.Exp2(-float64(m.at-m.t0)/float64(m.cfg.halfLife))
		}
	}
	if total == 0 { // nothing seen: each cell alike
		for i := range weights {
			weights[i] = 1
		}
		total = float64(len(weights))
	}
	// The mixture of the cells' curves, weighted by their observations.
	cdf := func(a float64) float64 {
		f := 0.0
		for i := range cells {
			f += weights[i] / total * (1 - survAt(&cells[i].surv, a))
		}
		return f
	}
	h := seconds(m.cfg.horizon)
	cs.Return = cdf(h)
	if cs.Return > 0 {
		cs.P50 = quantile(cdf, 0.5*cs.Return, h)
		cs.P90 = quantile(cdf, 0.9*cs.Return, h)
		cs.P99 = quantile(cdf, 0.99*cs.Return, h)
	}
	return cs
}

// quantile finds the age at which the non-decreasing cdf reaches p,
// between 0 and hi seconds, by bisection in log time.
func quantile(cdf func(float64) float64, p, hi float64) time.Duration {
	if cdf(1) >= p { // within the first second: linear there
		lo, up := 0.0, 1.0
		for range 40 {
			mid := (lo + up) / 2
			if cdf(mid) >= p {
				up = mid
			} else {
				lo = mid
			}
		}
		return fromSeconds(up)
	}
	lo, up := 0.0, math.Log2(hi)
	for range 50 {
		mid := (lo + up) / 2
		if cdf(math.Exp2(mid)) >= p {
			up = mid
		} else {
			lo = mid
		}
	}
	return fromSeconds(math.Exp2(up))
}
