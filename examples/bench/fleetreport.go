package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
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
	if rep.first != nil {
		ff := figures(*rep.first)
		fmt.Fprintf(w, "first run, hold everything with ample capacity (%s tokens per decode engine): mean KV in use per decode engine %s tokens (peak %s), %d preemptions on D\n",
			ktok(c.prof.KVCapacityTokens), ktok(rep.demand), ktok(maxOf(ff.usedPeak)), ff.dPreempt)
		fmt.Fprintf(w, "decode capacity: half of that, %s tokens per engine (%.1f GiB at %d KiB a token)\n",
			ktok(rep.capacity), gib(rep.capacity, c.prof.KVBytesPerToken), c.prof.KVBytesPerToken>>10)
	} else {
		fmt.Fprintf(w, "decode capacity: %s tokens per engine (%.1f GiB)\n", ktok(rep.capacity), gib(rep.capacity, c.prof.KVBytesPerToken))
	}
	h, m := figures(rep.hold), figures(rep.managed)
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name, a, b string) { fmt.Fprintf(tw, "%s\t%s\t%s\t\n", name, a, b) }
	mname := "managed"
	if c.clairvoyant {
		mname = "managed, clairvoyant"
	}
	row("", "hold everything", mname)
	row("turns answered (failed)", fmt.Sprintf("%d (%d)", h.turns-h.failed, h.failed), fmt.Sprintf("%d (%d)", m.turns-m.failed, m.failed))
	row("wrong answers", fmt.Sprint(h.wrong), fmt.Sprint(m.wrong))
	row("modelled time to the last answer", rep.hold.elapsed.Round(time.Second).String(), rep.managed.elapsed.Round(time.Second).String())
	row("turns per second (modelled)", fmt.Sprintf("%.3f", h.turnsPerSec), fmt.Sprintf("%.3f", m.turnsPerSec))
	row("TTFT p50 / p95 / p99", ttftString(h.ttft), ttftString(m.ttft))
	for i, b := range ctxBuckets {
		row(fmt.Sprintf("  prompt %s (turns)", b.name), fmt.Sprintf("%s (%d)", ttftString(h.byCtx[i]), len(h.byCtx[i])),
			fmt.Sprintf("%s (%d)", ttftString(m.byCtx[i]), len(m.byCtx[i])))
	}
	row("hit rate", pct(float64(h.hits), float64(h.turns)), pct(float64(m.hits), float64(m.turns)))
	row("reused prompt tokens", ktok(int(h.reused)), ktok(int(m.reused)))
	row("prompt tokens recomputed", pct(float64(h.computed), float64(h.prompt)), pct(float64(m.computed), float64(m.prompt)))
	for i := range h.heldPeak {
		row(fmt.Sprintf("D%d KV held: peak / mean", i), ktok(h.heldPeak[i])+" / "+ktok(h.heldMean[i]), ktok(m.heldPeak[i])+" / "+ktok(m.heldMean[i]))
	}
	budget := rep.managed.budgetTokens
	row(fmt.Sprintf("held within budget (%s) at every sample", ktok(budget)), withinString(budget, rep.hold.samples), withinString(budget, rep.managed.samples))
	row("D: requests queued / preemptions", fmt.Sprintf("%d / %d", h.dQueued, h.dPreempt), fmt.Sprintf("%d / %d", m.dQueued, m.dPreempt))
	row("D: tokens recomputed after preemption", ktok(h.dRecomp), ktok(m.dRecomp))
	row("D: most requests waiting at a sample", fmt.Sprint(h.waitingPeak), fmt.Sprint(m.waitingPeak))
	row("P: requests queued / preemptions", fmt.Sprintf("%d / %d", h.pQueued, h.pPreempt), fmt.Sprintf("%d / %d", m.pQueued, m.pPreempt))
	row("releases by reason (router)", releasesString(rep.hold), releasesString(rep.managed))
	tw.Flush()
	if c.clairvoyant {
		fmt.Fprintln(w, "managed, clairvoyant: the victims chosen by when each conversation's next turn comes (known from the plan, as no router can): a bound on any choice of victims with this budget")
	}
	printGapModel(w, rep.managed)
	fmt.Fprintln(w, "TTFT is modelled: the router's render call and prefill leg (P's queue, pull and prefill) and D's time to its first token (its queue, read of P's blocks, preemptions, first step).")
	fmt.Fprintln(w, "KV held: D's blocks pinned for holds (vLLM's decoder_kv_blocks_ttl), sampled every", c.sample, "of modelled time; recomputed: prompt tokens P computed rather than pulled.")
	return printTargets(w, rep, h, m)
}

// printFleetPlan prints the sessions as the arms ran them (both the same:
// which replies called the tool, and so the pauses and inputs, are the
// engines' answers, equal in every arm).
func printFleetPlan(w io.Writer, rep fleetReport) {
	c := rep.cfg
	tools, over50 := 0, 0
	var pauses []float64
	longest := map[int]int{} // session → its last prompt and reply
	for _, t := range rep.hold.turns {
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
	turns := len(rep.hold.turns)
	fmt.Fprintf(w, "Fleet: %d agent sessions (seed %d) arriving over %s, %d turns (%.1f a session), %dP%dD %s engines\n",
		len(rep.plan), c.seed, c.window, turns, float64(turns)/float64(len(rep.plan)), c.prefill, c.decode, c.profileName)
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

// overBudget counts the samples at which some engine's holds were over
// budget tokens.
func overBudget(samples []kvSample, budget int) int {
	over := 0
	for _, s := range samples {
		for _, v := range s.held {
			if v > budget {
				over++
				break
			}
		}
	}
	return over
}

func withinString(budget int, samples []kvSample) string {
	if budget <= 0 {
		return "-"
	}
	over := overBudget(samples, budget)
	if over == 0 {
		return "yes"
	}
	return fmt.Sprintf("no (%d of %d samples over)", over, len(samples))
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

// printGapModel prints the pauses between turns the managed arm's ledger
// learned, and the turns whose releases did not settle in time.
func printGapModel(w io.Writer, a armResult) {
	if len(a.gaps.Classes) > 0 {
		g := a.gaps.Classes[0]
		fmt.Fprintf(w, "managed: gap model learned online: next turn within %v %.2f; gap p50 %.0f s, p90 %.0f s, p99 %.0f s (%.0f observations)\n",
			a.gaps.Horizon, g.Return, g.P50.Seconds(), g.P90.Seconds(), g.P99.Seconds(), g.Observations)
	}
	if a.unsettled > 0 {
		fmt.Fprintf(w, "managed: %d turns' releases did not join the clock within %v of real time: the run may not repeat exactly\n", a.unsettled, settleWait)
	}
}
