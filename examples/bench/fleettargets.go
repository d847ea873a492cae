package main

import (
	"fmt"
	"io"
	"math"
)

// printTargets prints the decode memory targets for the fleet as
// PASS/FAIL lines, each with its target, and returns how many FAILed.
// Under pressure (capacity below the demand): the managed arm keeps every
// engine's holds within its budget at every sample, has no preemption on
// D while the live working set fits, a TTFT p99 at least 2x lower and
// turns per second at least as high as hold everything, and reuses at
// least 70% of the tokens hold everything reuses. With ample capacity:
// managed within 2% of hold everything on TTFT p50 and p99 and on reused
// tokens. Always: no answer differs from a single engine's.
func printTargets(w io.Writer, rep fleetReport, h, m armFigures) int {
	fails := 0
	check := func(ok bool, target, got string) {
		verdict := "PASS"
		if !ok {
			verdict = "FAIL"
			fails++
		}
		fmt.Fprintf(w, "%s  %s: %s\n", verdict, target, got)
	}
	fmt.Fprintln(w)
	check(h.wrong == 0 && m.wrong == 0 && h.failed == 0 && m.failed == 0,
		"every answer equals a single engine's (0 wrong, 0 failed)",
		fmt.Sprintf("hold everything %d wrong %d failed, managed %d wrong %d failed", h.wrong, h.failed, m.wrong, m.failed))
	hp50, hp99 := percentile(h.ttft, 50), percentile(h.ttft, 99)
	mp50, mp99 := percentile(m.ttft, 50), percentile(m.ttft, 99)
	if rep.ample {
		within := func(a, b float64) bool { return math.Abs(b-a) <= 0.02*math.Abs(a) }
		check(within(hp50, mp50), "ample capacity: managed TTFT p50 within 2% of hold everything's",
			fmt.Sprintf("%s vs %s (%+.1f%%)", fms(mp50), fms(hp50), change(mp50, hp50)))
		check(within(hp99, mp99), "ample capacity: managed TTFT p99 within 2% of hold everything's",
			fmt.Sprintf("%s vs %s (%+.1f%%)", fms(mp99), fms(hp99), change(mp99, hp99)))
		check(within(float64(h.reused), float64(m.reused)), "ample capacity: managed reused tokens within 2% of hold everything's",
			fmt.Sprintf("%s vs %s (%+.1f%%)", ktok(int(m.reused)), ktok(int(h.reused)), change(float64(m.reused), float64(h.reused))))
		return fails
	}
	budget := rep.managed.budgetTokens
	over := overBudget(rep.managed.samples, budget)
	check(over == 0, fmt.Sprintf("managed holds within the budget (%s tokens per engine) at every sample", ktok(budget)),
		fmt.Sprintf("%d of %d samples over, peak held %s", over, len(rep.managed.samples), ktok(maxOf(m.heldPeak))))
	fits := m.runningPeak <= rep.capacity
	check(m.dPreempt == 0 || !fits, "managed: no preemption on D while the live working set fits",
		fmt.Sprintf("%d preemptions; running requests took at most %s of %s tokens", m.dPreempt, ktok(m.runningPeak), ktok(rep.capacity)))
	check(hp99 >= 2*mp99, "managed TTFT p99 at least 2x lower than hold everything's",
		fmt.Sprintf("%s vs %s (%.1fx)", fms(mp99), fms(hp99), hp99/math.Max(mp99, 1e-9)))
	check(m.turnsPerSec >= h.turnsPerSec, "managed turns per second at least hold everything's",
		fmt.Sprintf("%.4f vs %.4f", m.turnsPerSec, h.turnsPerSec))
	check(float64(m.reused) >= 0.7*float64(h.reused), "managed reuses at least 70% of the prompt tokens hold everything reuses",
		fmt.Sprintf("%s vs %s (%s)", ktok(int(m.reused)), ktok(int(h.reused)), pct(float64(m.reused), float64(h.reused))))
	return fails
}

// change is a's change from b, in percent.
func change(a, b float64) float64 {
	if b == 0 {
		return 0
	}
	return 100 * (a - b) / b
}
