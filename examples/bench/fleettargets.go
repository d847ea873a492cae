package main

import (
	"fmt"
	"io"
	"math"
)

// printTargets prints the fleet's targets, each with what was measured,
// and returns how many failed: a wrong answer or failed turn always, a
// target not met only with --check. The targets are those decode memory
// management must meet in production's world, for the managed arm with
// --replicas routers: every engine's KV in use (the engine's
// kv_cache_usage_perc x capacity) within the budget at every sample and
// no preemption on D (unlimited memory has none: any is the holds');
// prompt tokens recomputed at most 1.05x unlimited memory's; reused
// tokens at least 85% of the offline bound's; with several replicas,
// within 3% of one replica on reused tokens and TTFT p50 and p99; with
// ample capacity, within 2% of hold everything on TTFT and reuse.
func printTargets(w io.Writer, rep fleetReport, figs []armFigures) int {
	fails := 0
	check := targetChecker(w, rep.cfg.check, &fails)
	fmt.Fprintln(w)
	arms := append([]armResult{rep.unlimited}, rep.arms...)
	wrong, failed := 0, 0
	for _, f := range figs {
		wrong += f.wrong
		failed += f.failed
	}
	check(true, wrong == 0 && failed == 0, "every answer in every arm equals a single engine's",
		fmt.Sprintf("%d wrong, %d failed", wrong, failed))
	idx := func(managed bool, replicas int) int {
		for i, a := range arms[1:] {
			if a.spec.managed == managed && a.spec.replicas == replicas {
				return i + 1
			}
		}
		return -1
	}
	n := rep.cfg.replicas
	mi := idx(true, n)
	if mi < 0 {
		return fails
	}
	m, u := figs[mi], figs[0]
	name := armLabel(arms[mi], false)
	mp50, mp99 := percentile(m.ttft, 50), percentile(m.ttft, 99)
	if rep.ample {
		hi := idx(false, n)
		h := figs[hi]
		within := func(a, b float64) bool { return math.Abs(b-a) <= 0.02*math.Abs(a) }
		hp50, hp99 := percentile(h.ttft, 50), percentile(h.ttft, 99)
		check(false, within(hp50, mp50) && within(hp99, mp99), "ample capacity: "+name+" TTFT p50 and p99 within 2% of hold everything's",
			fmt.Sprintf("%s / %s vs %s / %s", fms(mp50), fms(mp99), fms(hp50), fms(hp99)))
		check(false, within(float64(h.reused), float64(m.reused)), "ample capacity: "+name+" reused tokens within 2% of hold everything's",
			fmt.Sprintf("%s vs %s (%+.1f%%)", ktok(int(m.reused)), ktok(int(h.reused)), change(float64(m.reused), float64(h.reused))))
	} else {
		budget := rep.cfg.budgetTokens(rep.capacity)
		a := arms[mi]
		over := overBudget(a.samples, budget, true)
		check(false, over == 0 && m.dPreempt == 0, fmt.Sprintf("%s: every engine's KV in use within the budget (%s) at every sample, 0 preemptions", name, ktok(budget)),
			fmt.Sprintf("%d of %d samples over (peak %s of %s capacity), %d preemptions", over, len(a.samples), ktok(maxOf(m.usedPeak)), ktok(rep.capacity), m.dPreempt))
		r := ratio(m.computed, u.computed)
		check(false, r <= 1.05, name+": prompt tokens recomputed at most 1.05x unlimited memory's",
			fmt.Sprintf("%s vs %s (%.2fx)", pct(float64(m.computed), float64(m.prompt)), pct(float64(u.computed), float64(u.prompt)), r))
		b := rep.bounds[mi-1].bound
		check(false, float64(m.reused) >= 0.85*float64(b), name+": reused tokens at least 85% of the offline bound's",
			fmt.Sprintf("%s of %s (%s)", ktok(int(m.reused)), ktok(int(b)), pct(float64(m.reused), float64(b))))
	}
	if oi := idx(true, 1); n > 1 && oi > 0 {
		o := figs[oi]
		op50, op99 := percentile(o.ttft, 50), percentile(o.ttft, 99)
		within := func(a, b float64) bool { return math.Abs(a-b) <= 0.03*math.Abs(b) }
		check(false, within(float64(m.reused), float64(o.reused)), fmt.Sprintf("%s within 3%% of 1 replica on reused tokens", name),
			fmt.Sprintf("%s vs %s (%+.1f%%)", ktok(int(m.reused)), ktok(int(o.reused)), change(float64(m.reused), float64(o.reused))))
		check(false, within(mp50, op50) && within(mp99, op99), fmt.Sprintf("%s within 3%% of 1 replica on TTFT p50 and p99", name),
			fmt.Sprintf("%s / %s vs %s / %s (%+.1f%% / %+.1f%%)", fms(mp50), fms(mp99), fms(op50), fms(op99), change(mp50, op50), change(mp99, op99)))
	}
	return fails
}

// change is a's change from b, in percent.
func change(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return 100 * (a - b) / b
}

// targetChecker returns the function that prints a target's line, met or
// NOT MET with what was measured, and counts in fails a target not met
// that is hard (a wrong answer) or, with strict (--check), any.
func targetChecker(w io.Writer, strict bool, fails *int) func(hard, ok bool, target, got string) {
	return func(hard, ok bool, target, got string) {
		verdict := "met    "
		if !ok {
			verdict = "NOT MET"
			if hard || strict {
				*fails++
			}
		}
		fmt.Fprintf(w, "%s  %s: %s\n", verdict, target, got)
	}
}
