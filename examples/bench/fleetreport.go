package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

// ctxBuckets are the context-length buckets TTFT is reported by: a
// prompt of n tokens is in the first bucket whose bound exceeds n.
var ctxBuckets = []struct {
	name  string
	below int
}{{"<8k", 8000}, {"8-16k", 16000}, {"16-32k", 32000}, {"32-64k", 64000}, {">=64k", 1 << 62}}

// armFigures are one arm's figures.
type armFigures struct {
	turns, failed, wrong, hits          int
	prompt, reused, computed            int64
	ttft                                []float64 // ms, every answered turn
	byCtx                               [][]float64
	heldPeak, heldMean, usedPeak        []int // per decode engine
	runningPeak                         int   // the most tokens running requests took on one engine
	samples                             int
	dQueued, dPreempt, dRecomp, pQueued int
	pPreempt, waitingPeak               int
	unanswered                          int // replies that called the tool, left without the tool's result
	turnsPerSec                         float64
}

func figures(a armResult) armFigures {
	f := armFigures{byCtx: make([][]float64, len(ctxBuckets))}
	for _, t := range a.turns {
		f.turns++
		if t.err != "" {
			f.failed++
			continue
		}
		if t.wrong {
			f.wrong++
		}
		if t.hit {
			f.hits++
		}
		if t.tool && t.last {
			f.unanswered++
		}
		f.prompt += int64(t.prompt)
		f.reused += int64(t.reused)
		f.computed += int64(t.computed)
		ms := float64(t.ttft) / 1e6
		f.ttft = append(f.ttft, ms)
		for i, b := range ctxBuckets {
			if t.prompt < b.below {
				f.byCtx[i] = append(f.byCtx[i], ms)
				break
			}
		}
	}
	n := 0 // decode engines
	if len(a.samples) > 0 {
		n = len(a.samples[0].held)
	}
	f.heldPeak, f.heldMean, f.usedPeak = make([]int, n), make([]int, n), make([]int, n)
	sums := make([]int, n)
	for _, s := range a.samples {
		for i := range n {
			f.heldPeak[i] = max(f.heldPeak[i], s.held[i])
			f.usedPeak[i] = max(f.usedPeak[i], s.used[i])
			f.runningPeak = max(f.runningPeak, s.used[i]-s.held[i])
			f.waitingPeak = max(f.waitingPeak, s.waiting[i])
			sums[i] += s.held[i]
		}
	}
	f.samples = len(a.samples)
	for i := range n {
		f.heldMean[i] = sums[i] / max(len(a.samples), 1)
	}
	engineWrong := 0 // the engines' own count of outputs that differ from Reference
	for _, t := range a.turns {
		if t.dWaited {
			f.dQueued++
		}
	}
	for _, e := range a.decode {
		f.dPreempt += e.preemptions
		f.dRecomp += e.recomputed
		engineWrong += e.wrong
	}
	f.wrong = max(f.wrong, engineWrong)
	for _, e := range a.prefill {
		f.pQueued += e.queued
		f.pPreempt += e.preemptions
	}
	if a.elapsed > 0 {
		f.turnsPerSec = float64(f.turns-f.failed) / a.elapsed.Seconds()
	}
	return f
}

func ktok(n int) string {
	if n >= 1e6 {
		return fmt.Sprintf("%.2fM", float64(n)/1e6)
	}
	return fmt.Sprintf("%.0fk", float64(n)/1e3)
}

// printFleet prints the run and its targets, and returns how many FAILed.
func printFleet(w io.Writer, rep fleetReport) int {
	c := rep.cfg
	printFleetPlan(w, rep)
	uf := figures(rep.unlimited)
	fmt.Fprintf(w, "unlimited memory (hold everything, %s tokens per decode engine): mean KV in use per decode engine %s tokens (peak %s), %d preemptions on D\n",
		ktok(rep.unlimited.spec.capacity), ktok(rep.demand), ktok(maxOf(uf.usedPeak)), uf.dPreempt)
	if c.capacity == "half" {
		fmt.Fprintf(w, "decode capacity: half of that, %s tokens per engine (%.1f GiB at %d KiB a token)\n",
			ktok(rep.capacity), gib(rep.capacity, c.prof.KVBytesPerToken), c.prof.KVBytesPerToken>>10)
	} else {
		fmt.Fprintf(w, "decode capacity: %s tokens per engine (%.1f GiB)\n", ktok(rep.capacity), gib(rep.capacity, c.prof.KVBytesPerToken))
	}
	routing := "each turn to the next replica"
	if !c.spread {
		routing = "each session pinned to one replica"
	}
	ledger := "the managed replicas share one ledger (kvroute.DecodeMemory.Ledger)"
	if c.perReplica {
		ledger = "each managed replica budgets with its own ledger (--ledger per-replica)"
	}
	fmt.Fprintf(w, "router replicas share one Store (%s); %s\n\n", routing, ledger)
	arms := append([]armResult{rep.unlimited}, rep.arms...)
	figs := make([]armFigures, len(arms))
	for i, a := range arms {
		figs[i] = figures(a)
	}
	bounds := append([]fleetBound{{}}, rep.bounds...)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, cell func(i int, a armResult, f armFigures) string) {
		fmt.Fprintf(tw, "%s\t", name)
		for i, a := range arms {
			fmt.Fprintf(tw, "%s\t", cell(i, a, figs[i]))
		}
		fmt.Fprintln(tw)
	}
	row("", func(i int, a armResult, _ armFigures) string { return armLabel(a, i == 0) })
	row("turns answered (failed)", func(_ int, _ armResult, f armFigures) string {
		return fmt.Sprintf("%d (%d)", f.turns-f.failed, f.failed)
	})
	row("wrong answers", func(_ int, _ armResult, f armFigures) string { return fmt.Sprint(f.wrong) })
	row("TTFT p50 / p99", func(_ int, _ armResult, f armFigures) string {
		return fms(percentile(f.ttft, 50)) + " / " + fms(percentile(f.ttft, 99))
	})
	row("turns per second (modelled)", func(_ int, _ armResult, f armFigures) string { return fmt.Sprintf("%.3f", f.turnsPerSec) })
	row("prompt tokens recomputed", func(_ int, _ armResult, f armFigures) string {
		return fmt.Sprintf("%s (%.2fx)", pct(float64(f.computed), float64(f.prompt)), ratio(f.computed, uf.computed))
	})
	row("hit rate", func(_ int, _ armResult, f armFigures) string { return pct(float64(f.hits), float64(f.turns)) })
	row("reused tokens (pulled from D)", func(_ int, _ armResult, f armFigures) string { return ktok(int(f.reused)) })
	row("offline bound at this memory", func(i int, _ armResult, _ armFigures) string {
		if i == 0 {
			return "-"
		}
		return fmt.Sprintf("%s (schedule %s)", ktok(int(bounds[i].bound)), ktok(int(bounds[i].schedule)))
	})
	row("reused, of the offline bound", func(i int, _ armResult, f armFigures) string {
		if i == 0 {
			return "-"
		}
		return pct(float64(f.reused), float64(bounds[i].bound))
	})
	row("D KV held: peak / mean (max engine)", func(_ int, _ armResult, f armFigures) string {
		return ktok(maxOf(f.heldPeak)) + " / " + ktok(maxOf(f.heldMean))
	})
	row("D KV in use: peak (max engine)", func(_ int, _ armResult, f armFigures) string { return ktok(maxOf(f.usedPeak)) })
	budget := c.budgetTokens(rep.capacity)
	row(fmt.Sprintf("samples in use over budget (%s)", ktok(budget)), func(i int, a armResult, _ armFigures) string {
		if i == 0 {
			return "-"
		}
		return fmt.Sprintf("%d of %d", overBudget(a.samples, budget, true), len(a.samples))
	})
	row("samples held over budget", func(i int, a armResult, _ armFigures) string {
		if i == 0 {
			return "-"
		}
		return fmt.Sprintf("%d of %d", overBudget(a.samples, budget, false), len(a.samples))
	})
	row("D: legs queued / preemptions", func(_ int, _ armResult, f armFigures) string { return fmt.Sprintf("%d / %d", f.dQueued, f.dPreempt) })
	row("P: requests queued / preemptions", func(_ int, _ armResult, f armFigures) string { return fmt.Sprintf("%d / %d", f.pQueued, f.pPreempt) })
	row("tool calls unanswered", func(_ int, _ armResult, f armFigures) string { return fmt.Sprint(f.unanswered) })
	row("releases by reason (routers)", func(_ int, a armResult, _ armFigures) string { return releasesString(a) })
	tw.Flush()
	printGapModels(w, rep)
	fmt.Fprintln(w, "TTFT is modelled: the router's render call and prefill leg (P's queue, pull and prefill) and D's time to its first token (its queue, read of P's blocks, preemptions, first step).")
	fmt.Fprintln(w, "recomputed: prompt tokens P computed (neither in its prefix cache nor pulled from D), and as a ratio to unlimited memory's; preemptions on D: unlimited memory has none, so at this memory they are the holds'.")
	fmt.Fprintln(w, "in use: D's blocks allocated (holds and running legs: the engine's kv_cache_usage_perc x capacity), held: pinned for holds; sampled every", c.sample, "of modelled time.")
	fmt.Fprintln(w, "offline bound: the most any release policy could reuse at this memory knowing every arrival, on this arm's recorded arrivals and placement (BENCHMARKS.md section 10); schedule: whole holds a clairvoyant policy keeps, the optimum lies between.")
	return printTargets(w, rep, figs)
}

// armLabel names an arm's column.
func armLabel(a armResult, unlimited bool) string {
	n := fmt.Sprintf("%d %s", a.spec.replicas, plural(a.spec.replicas, "replica"))
	switch {
	case unlimited:
		return "unlimited, " + n
	case a.spec.managed:
		return "managed, " + n
	}
	return "hold everything, " + n
}

func ratio(a, b int64) float64 {
	if b == 0 {
		return 0
	}
	return float64(a) / float64(b)
}

// printFleetPlan prints the sessions as the arms ran them (both the same:
// which replies called the tool, and so the pauses and inputs, are the
// engines' answers, equal in every arm).
func printFleetPlan(w io.Writer, rep fleetReport) {
	c := rep.cfg
	tools, over50 := 0, 0
	var pauses []float64
	longest := map[int]int{} // session → its last prompt and reply
	for _, t := range rep.unlimited.turns {
		if t.tool {
			tools++
		}
		if t.pause > 0 {
			pauses = append(pauses, t.pause.Seconds())
		}
		longest[t.session] = max(longest[t.session], t.prompt+rep.plan[t.session].turns[t.turn].minTokens)
	}
	maxP := 0
	for _, p := range longest {
		maxP = max(maxP, p)
		if p >= 50000 {
			over50++
		}
	}
	turns := len(rep.unlimited.turns)
	shared := 0
	for _, sp := range rep.plan {
		if sp.shared {
			shared++
		}
	}
	caching := "on"
	if c.noPrefixCache {
		caching = "off"
	}
	fmt.Fprintf(w, "Fleet: %d agent sessions (seed %d) arriving over %s, %d turns (%.1f a session), %dP%dD %s engines, prefix caching on P %s\n",
		len(rep.plan), c.seed, c.window, turns, float64(turns)/float64(len(rep.plan)), c.prefill, c.decode, c.profileName, caching)
	fmt.Fprintf(w, "%d sessions (%.0f%%) share one %d-token system prompt; the others have their own of 2k-8k tokens\n",
		shared, 100*float64(shared)/float64(max(len(rep.plan), 1)), sharedSystemTokens)
	fmt.Fprintf(w, "pauses between turns: p50 %.0f s, p90 %.0f s, p99 %.0f s (%.0f%% of the replies called the tool under tool_choice auto); %d sessions reach 50k+ tokens (longest %s)\n",
		percentile(pauses, 50), percentile(pauses, 90), percentile(pauses, 99), 100*float64(tools)/float64(max(turns, 1)), over50, ktok(maxP))
}

func gib(tokens int, bytesPerToken int64) float64 {
	return float64(tokens) * float64(bytesPerToken) / (1 << 30)
}

func maxOf(vs []int) int {
	m := 0
	for _, v := range vs {
		m = max(m, v)
	}
	return m
}

func ttftString(ms []float64) string {
	if len(ms) == 0 {
		return "-"
	}
	return fmt.Sprintf("%s / %s / %s", fms(percentile(ms, 50)), fms(percentile(ms, 95)), fms(percentile(ms, 99)))
}

func fms(ms float64) string {
	if ms >= 10000 {
		return fmt.Sprintf("%.1f s", ms/1000)
	}
	return fmt.Sprintf("%.0f ms", ms)
}

// overBudget counts the samples at which some engine's KV in use (used)
// or held for holds (!used) was over budget tokens.
func overBudget(samples []kvSample, budget int, used bool) int {
	over := 0
	for _, s := range samples {
		vs := s.held
		if used {
			vs = s.used
		}
		for _, v := range vs {
			if v > budget {
				over++
				break
			}
		}
	}
	return over
}

func releasesString(a armResult) string {
	var parts []string
	for _, r := range routerReleases(a.router) {
		parts = append(parts, fmt.Sprintf("%s %d", r.reason, r.n))
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

// printGapModels prints the pauses between turns each managed ledger (one
// for every replica, or one a replica) learned, and the turns whose
// releases did not settle in time.
func printGapModels(w io.Writer, rep fleetReport) {
	for _, a := range rep.arms {
		for k, g := range a.gaps {
			if len(g.Classes) == 0 {
				continue
			}
			cl := g.Classes[0]
			whose := fmt.Sprintf("replica %d", k)
			if len(a.gaps) == 1 && a.spec.replicas > 1 {
				whose = "one ledger"
			}
			fmt.Fprintf(w, "%s, %s: gap model learned: next turn within %v %.2f; gap p50 %.0f s, p90 %.0f s, p99 %.0f s (%.0f observations)\n",
				armLabel(a, false), whose, g.Horizon, cl.Return, cl.P50.Seconds(), cl.P90.Seconds(), cl.P99.Seconds(), cl.Observations)
		}
		if a.unsettled > 0 {
			fmt.Fprintf(w, "%s: %d turns' releases did not join the clock within %v of real time: the run may not repeat exactly\n", armLabel(a, false), a.unsettled, settleWait)
		}
	}
}
