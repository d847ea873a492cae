package main

import (
	"context"
	"fmt"
	"io"
	"strconv"
	"sync/atomic"
	"text/tabwriter"
	"time"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The CPU tier head-to-head (--cpu-tier): the same sessions on the same
// engines, each with a CPU tier twice its KV capacity (vLLM's
// OffloadingConnector behind NIXL, generated blocks written through, the
// peer tier on: docs/cpu-tier.md), served five ways:
//
//   - unlimited memory: every hold kept on D for the TTL at the node's
//     capacity, the reference for what reuse can save;
//   - plain P/D: stock one-way engines (D keeps nothing), no reuse;
//   - GPU holds only: today's bidirectional transfer, with a quarter of
//     hold-everything's GPU memory for holds (the budget);
//   - CPU tier only: llm-d's P2P path, every hold released as soon as it
//     is retained, so that D keeps nothing on its GPU and each next turn's
//     prefill engine pulls the history from D's CPU tier;
//   - both: GPU holds within the quarter, and a turn whose hold the
//     budget released (or that expired) pulls from D's CPU tier, as the
//     cost model chooses (kvroute.DecodeMemory.CPUTierTokens); a hold the
//     tier holds whole is pulled from the tier too, unverified (no render
//     on the turn's way: kvroute.DecodeMemory.CPUTierFirst), the GPU hold
//     serving the turns whose history the tier lost;
//
//   - both, decode-local too: the combined arm whose cost model may also
//     answer a turn on its decode engine (kvroute.DecodeMemory.Local),
//     which reloads a released hold's history from its own tier: shown,
//     not a target (a decode-local turn's suffix is computed again by the
//     next turn's prefill engine, so it trades prefill work for TTFT).
//
// The decode engines have the --capacity of the other fleet runs (half of
// unlimited memory's mean demand by default, where holding everything does
// not fit; peak: what holding everything uses at its peak, where it just
// fits), and the GPU holds a quarter of what holding everything holds at
// that capacity. The targets are the combined arm's: at least 95% of unlimited memory's
// prefill savings (prompt tokens plain P/D computes that the arm does
// not), no preemption on D, no wrong answer, and a TTFT p99 below each
// single-path arm's.

// defaultTierFactor is each engine's CPU tier as a multiple of its KV
// capacity (--tier-factor; llm-d's recommendation, from its measured runs).
const defaultTierFactor = 2.0

// tierTokens is an engine's CPU tier for a KV capacity of capacity tokens.
func (c fleetConfig) tierTokens(capacity int) int { return int(c.tierFactor * float64(capacity)) }

// tierOption is an engine's CPU tier in arm a, for its KV capacity in
// tokens: none unless the arm runs the head-to-head.
func tierOption(c fleetConfig, a armSpec, capacity int) kvroutetest.Option {
	if !a.tier {
		return kvroutetest.WithCPUTier(kvroutetest.CPUTier{})
	}
	return kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: c.tierTokens(capacity) / kvroutetest.DefaultBlockSize,
		OffloadGenerated: true, P2P: true})
}

// tierReport is a --cpu-tier run.
type tierReport struct {
	cfg      fleetConfig
	plan     []sessionPlan
	capacity int         // per decode engine
	holds    int         // the GPU holds' budget per decode engine, tokens
	arms     []armResult // unlimited, plain, GPU, CPU, both
}

// The arms' indexes in tierReport.arms.
const (
	tierUnlimited = iota
	tierPlain
	tierGPU
	tierCPU
	tierBoth
	tierBothLocal
)

func fleetTierRun(ctx context.Context, c fleetConfig, progress io.Writer) (tierReport, error) {
	rep := tierReport{cfg: c, plan: planFleet(c.seed, c.sessions, c.window, c.maxTurns, c.maxPrompt, c.sharedShare)}
	ample := c.prof.KVCapacityTokens / kvroutetest.DefaultBlockSize * kvroutetest.DefaultBlockSize
	run := func(a armSpec) error {
		a.name = fmt.Sprintf("%s, %d %s", a.name, c.replicas, plural(c.replicas, "replica"))
		a.replicas, a.tier, a.done = c.replicas, true, new(atomic.Int64)
		start := time.Now()
		stop := every(progress, progressInterval, func() string {
			return fmt.Sprintf("fleet: %s: %d of %d sessions done, %s real time", a.name, a.done.Load(), len(rep.plan),
				time.Since(start).Round(time.Second))
		})
		res, err := runArm(ctx, c, rep.plan, a)
		stop()
		if err != nil {
			return err
		}
		fmt.Fprintf(progress, "fleet: %s, capacity %d tokens per decode engine: %d turns in %s real time\n",
			a.name, a.capacity, len(res.turns), res.real.Round(time.Millisecond))
		rep.arms = append(rep.arms, res)
		return nil
	}
	if err := run(armSpec{name: "unlimited memory", capacity: ample}); err != nil {
		return rep, err
	}
	u := rep.arms[0]
	uf := figures(u)
	switch c.capacity {
	case "ample":
		rep.capacity = ample
	case "half":
		rep.capacity = max(meanDemand(u)/2/kvroutetest.DefaultBlockSize*kvroutetest.DefaultBlockSize,
			c.maxPrompt+replyMax+callRoom+kvroutetest.DefaultBlockSize)
	case "peak":
		// What holding everything uses on an engine at its peak: hold
		// everything fits, and the others hold a quarter of it.
		rep.capacity = maxOf(uf.usedPeak) / kvroutetest.DefaultBlockSize * kvroutetest.DefaultBlockSize
	default:
		rep.capacity, _ = strconv.Atoi(c.capacity)
	}
	// A quarter of what holding everything holds on an engine at its
	// peak at this capacity (all of it, when it does not fit).
	rep.holds = min(maxOf(uf.heldPeak), rep.capacity) / 4
	quarter := float64(rep.holds) / float64(rep.capacity)
	for _, a := range []armSpec{
		{name: "plain P/D", plain: true},
		{name: "GPU holds only", managed: true, holdFraction: quarter},
		// One block of budget: every hold is over it, and released as soon
		// as it is retained (D keeps nothing for long on its GPU; llm-d's
		// D keeps nothing at all, at no release request).
		{name: "CPU tier only", managed: true, holdFraction: float64(kvroutetest.DefaultBlockSize) / float64(rep.capacity), peer: true},
		{name: "both (cost model)", managed: true, holdFraction: quarter, peer: true, tierFirst: true},
		{name: "both, decode-local too", managed: true, holdFraction: quarter, peer: true, tierFirst: true, local: true},
	} {
		a.capacity = rep.capacity
		if err := run(a); err != nil {
			return rep, err
		}
	}
	return rep, nil
}

// tierFigures are what the head-to-head reports of an arm beyond
// armFigures.
type tierFigures struct {
	peerAsked  int   // turns whose prefill leg named D's tier
	tier, peer int64 // prompt tokens P loaded from a CPU tier, and of them from D's
	local      int   // decode-local turns
	dTier      int64 // tokens their D reloaded from its own tier
	saved      int64 // prompt tokens plain P/D computed that this arm did not
}

func tierFiguresOf(a armResult, plain armFigures, f armFigures) tierFigures {
	var t tierFigures
	for _, tr := range a.turns {
		if tr.peerAsked {
			t.peerAsked++
		}
		t.tier += int64(tr.tier)
		t.peer += int64(tr.peer)
		t.dTier += int64(tr.dTier)
		if tr.local {
			t.local++
		}
	}
	t.saved = plain.computed - f.computed
	return t
}

// printTier prints the head-to-head and its targets, and returns how many
// FAILed (a wrong answer always; a target not met with --check).
func printTier(w io.Writer, rep tierReport) int {
	c := rep.cfg
	printFleetPlan(w, fleetReport{cfg: c, plan: rep.plan, unlimited: rep.arms[tierUnlimited]})
	fmt.Fprintf(w, "decode capacity: %s tokens per engine (%.1f GiB); CPU tier %gx the KV capacity on every engine (%s tokens per decode engine); GPU holds: a quarter of what holding everything holds at this capacity, %s tokens per decode engine\n\n",
		ktok(rep.capacity), gib(rep.capacity, c.prof.KVBytesPerToken), c.tierFactor, ktok(c.tierTokens(rep.capacity)), ktok(rep.holds))
	figs := make([]armFigures, len(rep.arms))
	for i, a := range rep.arms {
		figs[i] = figures(a)
	}
	tf := make([]tierFigures, len(rep.arms))
	for i, a := range rep.arms {
		tf[i] = tierFiguresOf(a, figs[tierPlain], figs[i])
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	row := func(name string, cell func(i int, f armFigures, t tierFigures) string) {
		fmt.Fprintf(tw, "%s\t", name)
		for i := range rep.arms {
			fmt.Fprintf(tw, "%s\t", cell(i, figs[i], tf[i]))
		}
		fmt.Fprintln(tw)
	}
	row("", func(i int, _ armFigures, _ tierFigures) string { return rep.arms[i].spec.name })
	row("turns answered (failed)", func(_ int, f armFigures, _ tierFigures) string {
		return fmt.Sprintf("%d (%d)", f.turns-f.failed, f.failed)
	})
	row("wrong answers", func(_ int, f armFigures, _ tierFigures) string { return fmt.Sprint(f.wrong) })
	row("TTFT p50 / p95 / p99", func(_ int, f armFigures, _ tierFigures) string {
		return fms(percentile(f.ttft, 50)) + " / " + fms(percentile(f.ttft, 95)) + " / " + fms(percentile(f.ttft, 99))
	})
	row("prompt tokens recomputed", func(_ int, f armFigures, _ tierFigures) string {
		return pct(float64(f.computed), float64(f.prompt))
	})
	row("prefill savings over plain P/D", func(i int, _ armFigures, t tierFigures) string {
		if i == tierPlain {
			return "-"
		}
		return fmt.Sprintf("%s (%s of unlimited's)", ktok(int(t.saved)), pct(float64(t.saved), float64(tf[tierUnlimited].saved)))
	})
	row("pulled from D's GPU holds", func(_ int, f armFigures, _ tierFigures) string { return ktok(int(f.reused)) })
	row("loaded from D's CPU tier (turns asked / skipped)", func(i int, _ armFigures, t tierFigures) string {
		var skipped int64
		for _, s := range rep.arms[i].router {
			skipped += s.PeerSkipped
		}
		return fmt.Sprintf("%s (%d / %d)", ktok(int(t.peer)), t.peerAsked, skipped)
	})
	row("loaded from P's own CPU tier", func(_ int, _ armFigures, t tierFigures) string { return ktok(int(t.tier - t.peer)) })
	row("decode-local turns (reloaded from D's tier)", func(_ int, _ armFigures, t tierFigures) string {
		return fmt.Sprintf("%d (%s)", t.local, ktok(int(t.dTier)))
	})
	row("D KV held: peak / mean (max engine)", func(_ int, f armFigures, _ tierFigures) string {
		return ktok(maxOf(f.heldPeak)) + " / " + ktok(maxOf(f.heldMean))
	})
	row("D: legs queued / preemptions", func(_ int, f armFigures, _ tierFigures) string {
		return fmt.Sprintf("%d / %d", f.dQueued, f.dPreempt)
	})
	row("releases by reason (routers)", func(i int, _ armFigures, _ tierFigures) string { return releasesString(rep.arms[i]) })
	tw.Flush()
	fmt.Fprintln(w, "TTFT is modelled (render, P's queue, pull or tier load and prefill, D's first token); the CPU tier's costs (device-to-host writes, the peer pull as a NIXL read, host-to-device loads) are the simulator's assumed prices (internal/sim/cost.go), not measurements.")
	fmt.Fprintln(w, "prefill savings: prompt tokens plain P/D computed that the arm did not, on P or (decode-local turns) on D: reused from D's GPU holds, D's CPU tier, the engines' prefix caches and their own CPU tiers.")
	if c.diagnose {
		for i, a := range rep.arms {
			printTail(w, a, figs[i])
		}
	}
	return tierTargets(w, rep, figs, tf)
}

func tierTargets(w io.Writer, rep tierReport, figs []armFigures, tf []tierFigures) int {
	fails := 0
	check := targetChecker(w, rep.cfg.check, &fails)
	fmt.Fprintln(w)
	wrong, failed := 0, 0
	for _, f := range figs {
		wrong += f.wrong
		failed += f.failed
	}
	check(true, wrong == 0 && failed == 0, "every answer in every arm equals a single engine's", fmt.Sprintf("%d wrong, %d failed", wrong, failed))
	b, u := tf[tierBoth], tf[tierUnlimited]
	check(false, float64(b.saved) >= 0.95*float64(u.saved), "both: at least 95% of unlimited memory's prefill savings",
		fmt.Sprintf("%s of %s (%s)", ktok(int(b.saved)), ktok(int(u.saved)), pct(float64(b.saved), float64(u.saved))))
	check(false, figs[tierBoth].dPreempt == 0, "both: 0 preemptions on D", fmt.Sprint(figs[tierBoth].dPreempt))
	p99 := func(i int) float64 { return percentile(figs[i].ttft, 99) }
	check(false, p99(tierBoth) < p99(tierGPU) && p99(tierBoth) < p99(tierCPU), "both: TTFT p99 below GPU holds only's and CPU tier only's",
		fmt.Sprintf("%s vs %s and %s", fms(p99(tierBoth)), fms(p99(tierGPU)), fms(p99(tierCPU))))
	return fails
}
