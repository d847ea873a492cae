package main

import (
	"math"
	"slices"
	"time"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The offline bound: the most prompt tokens any release policy could have
// P pull from D's holds at this decode memory, knowing every future
// arrival, computed after the run on an arm's recorded arrivals.
//
// Every hold that can be reused is an interval on one decode engine: turn
// k of a session leaves its KV on the engine that decoded it when its
// answer comes (start), and turn k+1 can pull it once it is sent (end).
// Keeping it costs its blocks over that interval and is worth the tokens
// its pull saves (value). The engine's capacity at time t, less what its
// running decode legs take then, is shared by the holds kept over t. The
// bound is the optimum of a relaxation of that choice, with every
// simplification in the policy's favour:
//
//   - a hold may be kept in part (a fractional knapsack in every instant);
//   - it costs only from its answer to the next turn's send (a real hold
//     is pinned from D's finish until P's pull, and a release policy has
//     to keep it from the answer on);
//   - the blocks of the common system prompt are free (D's prefix cache
//     stores them once), in holds and in running legs alike, and so is
//     each hold's last block;
//   - a running leg takes only its prompt's blocks, and only while it
//     decodes (not while it waits, is prefilled or grows);
//   - a hold is worth what its pull would save: the next turn's prompt
//     tokens it covers beyond what P found in its prefix cache for that
//     turn (as recorded: P's cache holds what P computed or pulled, so
//     its contents do not depend on which holds D kept), or what the pull
//     did save, if more; a hold whose next turn came after the retention
//     TTL, or never, is worth nothing.
//
// Placement (which engines serve each turn) and timing are the arm's as
// recorded: the bound is on release policies, not on placement or
// queueing. The relaxation is a linear program over intervals; its
// capacity constraints are summed over one-second slots (implied by the
// pointwise ones, so the relaxation only grows), and any dual solution of
// it bounds its optimum from above (weak duality): for prices λ_j ≥ 0 per
// token-second of slot j, bound = Σ_j λ_j·A_j + Σ_i max(0, v_i − size_i·Σ_j
// λ_j·overlap_ij), A_j the slot's free token-seconds. Projected subgradient
// steps (Polyak's, towards a little below the best value yet) lower it; every
// iterate is a valid bound, so the smallest is printed. The arm's own hits
// are a feasible choice in the relaxation, so the bound is at least the
// arm's reuse. A feasible schedule of whole holds (greedy by value per
// token-second, checked against the capacity per second) shows how close
// the bound is: the optimum lies between the two.

// boundSlot is the bound's time slot.
const boundSlot = time.Second

// boundIterations is the number of subgradient steps.
const boundIterations = 1000

// fleetBound is the offline bound on one arm's recorded arrivals.
type fleetBound struct {
	bound    int64 // an upper bound on the tokens any release policy reuses
	schedule int64 // what a feasible clairvoyant schedule of whole holds reuses
	reusable int64 // every hold's value: what unlimited memory would reuse on this placement
	holds    int   // holds worth something
}

// boundItem is one hold: its interval in slots (float seconds), its cost
// in tokens and its value.
type boundItem struct {
	start, end float64
	size       float64
	value      float64
}

// boundLeg is a running decode leg: its interval and blocks.
type boundLeg struct {
	start, end float64
	size       float64
}

// offlineBound computes the bound on arm a's recorded arrivals; ttl is
// the routers' retention TTL.
func offlineBound(a armResult, plan []sessionPlan, capacity int, ttl time.Duration) fleetBound {
	type key struct{ s, t int }
	next := map[key]fleetTurn{}
	for _, t := range a.turns {
		next[key{t.session, t.turn}] = t
	}
	bs := kvroutetest.DefaultBlockSize
	shared := (sharedSystemTokens + 64 + bs - 1) / bs * bs // the common prompt's blocks, with the template's tokens
	free := func(session, tokens int) float64 {
		n := tokens / bs * bs
		if plan[session].shared {
			n -= shared
		}
		return float64(max(n, 0))
	}
	items := make([][]boundItem, 0)
	legs := make([][]boundLeg, 0)
	grow := func(e int) {
		for len(items) <= e {
			items = append(items, nil)
			legs = append(legs, nil)
		}
	}
	var out fleetBound
	for _, t := range a.turns {
		if t.err != "" || t.decode < 0 {
			continue
		}
		grow(t.decode)
		end := t.answered.Seconds()
		legs[t.decode] = append(legs[t.decode], boundLeg{start: end - t.decodeTime.Seconds(), end: end, size: free(t.session, t.dPrompt)})
		n, ok := next[key{t.session, t.turn + 1}]
		if !ok {
			continue
		}
		v := n.reused
		if n.err == "" && n.sent-t.answered <= ttl {
			v = max(v, min(t.dPrompt+t.dCompletion, n.prompt)-n.cached)
		}
		if v <= 0 {
			continue
		}
		out.holds++
		out.reusable += int64(v)
		items[t.decode] = append(items[t.decode], boundItem{start: end, end: max(n.sent.Seconds(), end),
			size: max(free(t.session, t.dPrompt+t.dCompletion)-float64(bs), 0), value: float64(v)})
	}
	for e := range items {
		b, s := engineBound(items[e], legs[e], float64(capacity))
		out.bound += int64(math.Ceil(b))
		out.schedule += int64(s)
	}
	return out
}

// engineBound is one decode engine's bound and feasible schedule.
func engineBound(items []boundItem, legs []boundLeg, capacity float64) (bound, schedule float64) {
	if len(items) == 0 {
		return 0, 0
	}
	horizon := 0.0
	for _, it := range items {
		horizon = max(horizon, it.end)
	}
	for _, l := range legs {
		horizon = max(horizon, l.end)
	}
	slot := boundSlot.Seconds()
	n := int(horizon/slot) + 2
	// free[j]: the slot's free token-seconds; worst[j]: the least free
	// tokens at any instant of the slot (for the feasible schedule)
	free, worst := make([]float64, n), make([]float64, n)
	live := make([]float64, n) // the most tokens running legs take in the slot
	for j := range free {
		free[j] = capacity * slot
	}
	for _, l := range legs {
		for j := int(l.start / slot); j < n && float64(j)*slot < l.end; j++ {
			free[j] -= l.size * overlap(l.start, l.end, float64(j)*slot, float64(j+1)*slot)
			live[j] += l.size
		}
	}
	for j := range worst {
		worst[j] = capacity - live[j]
	}
	schedule = greedySchedule(items, worst, slot)
	return dualBound(items, free, slot, schedule), schedule
}

func overlap(a0, a1, b0, b1 float64) float64 { return max(0, min(a1, b1)-max(a0, b0)) }

// greedySchedule keeps whole holds, most valuable per token-second first,
// where they fit at every slot they touch.
func greedySchedule(items []boundItem, worst []float64, slot float64) float64 {
	order := make([]int, len(items))
	for i := range order {
		order[i] = i
	}
	density := func(it boundItem) float64 { return it.value / (it.size*(it.end-it.start) + 1) }
	slices.SortStableFunc(order, func(a, b int) int {
		da, db := density(items[a]), density(items[b])
		switch {
		case da > db:
			return -1
		case da < db:
			return 1
		}
		return 0
	})
	used := make([]float64, len(worst))
	total := 0.0
	for _, i := range order {
		it := items[i]
		j0, j1 := int(it.start/slot), min(int(it.end/slot), len(worst)-1)
		fits := true
		for j := j0; j <= j1 && fits; j++ {
			fits = used[j]+it.size <= worst[j]
		}
		if !fits {
			continue
		}
		for j := j0; j <= j1; j++ {
			used[j] += it.size
		}
		total += it.value
	}
	return total
}

// dualBound minimises the relaxation's dual over slot prices λ ≥ 0 by
// projected subgradient steps and returns the least value seen (each a
// valid upper bound); target is a feasible value, below the optimum.
func dualBound(items []boundItem, free []float64, slot, target float64) float64 {
	n := len(free)
	lambda := make([]float64, n)
	prefix := make([]float64, n+1) // prefix[j]: Σ_{k<j} λ_k
	diff := make([]float64, n+1)
	grad := make([]float64, n)
	best, delta, stale := math.Inf(1), -1.0, 0
	// price over [s, e) of λ, per token: Σ_j λ_j·overlap_j
	price := func(s, e float64) float64 {
		j0, j1 := int(s/slot), int(e/slot)
		if j0 == j1 {
			return lambda[j0] * (e - s)
		}
		p := lambda[j0]*(float64(j0+1)*slot-s) + lambda[j1]*(e-float64(j1)*slot)
		return p + (prefix[j1]-prefix[j0+1])*slot
	}
	for it := 0; it < boundIterations; it++ {
		for j := range lambda {
			prefix[j+1] = prefix[j] + lambda[j]
		}
		clear(diff)
		clear(grad)
		f := 0.0
		for j := range free {
			f += lambda[j] * free[j]
			grad[j] = free[j]
		}
		for _, x := range items {
			if x.value <= x.size*price(x.start, x.end) {
				continue
			}
			f += x.value - x.size*price(x.start, x.end)
			// the hold is kept: it takes size tokens over its interval
			j0, j1 := int(x.start/slot), int(x.end/slot)
			if j0 == j1 {
				grad[j0] -= x.size * (x.end - x.start)
				continue
			}
			grad[j0] -= x.size * (float64(j0+1)*slot - x.start)
			grad[j1] -= x.size * (x.end - float64(j1)*slot)
			diff[j0+1] += x.size * slot
			diff[j1] -= x.size * slot
		}
		run, norm := 0.0, 0.0
		for j := range grad {
			run += diff[j]
			grad[j] -= run
			// projected: a price at 0 with a positive gradient stays
			if lambda[j] > 0 || grad[j] < 0 {
				norm += grad[j] * grad[j]
			}
		}
		if f < best-1e-9*f {
			best, stale = f, 0
		} else if stale++; stale == 20 {
			delta, stale = delta/2, 0
		}
		if delta < 0 {
			delta = max(best-target, 0.01*best) / 2
		}
		if norm == 0 || delta <= 1e-6*best {
			break
		}
		// Polyak's step towards best - delta, delta halving when the
		// steps stop improving
		step := (f - (best - delta)) / norm
		for j := range lambda {
			lambda[j] = max(0, lambda[j]-step*grad[j])
		}
	}
	return best
}
