package main

import (
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"io"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// smallFleet is a fleet of a few seconds of CPU: short prompts, a small
// decode capacity, two router replicas.
func smallFleet(t *testing.T, capacity, sessions string, extra ...string) fleetConfig {
	t.Helper()
	c, err := parseFleetFlags(append([]string{"--fleet", "--sessions", sessions, "--window", "1m", "--max-turns", "6",
		"--max-prompt", "20000", "--capacity", capacity, "--prefill", "1", "--decode", "2", "--replicas", "2", "--timeout", "8m"}, extra...), io.Discard)
	require.NoError(t, err)
	return c
}

// Every arm and the offline bound on a small fleet: every answer equals a
// single engine's, the decode engines never hold more than their
// capacity, the bound is at least every arm's reuse and unlimited memory
// recomputes least, the replicas share one Store (a turn finds the hold
// another replica retained), every tool call is answered, and every
// figure is printed.
func TestFleetSmall(t *testing.T) {
	c := smallFleet(t, "half", "10")
	rep, err := fleetRun(context.Background(), c, io.Discard)
	require.NoError(t, err)
	assert.Positive(t, rep.demand)
	require.Len(t, rep.arms, 4, "hold everything and managed, with 2 replicas and with 1")
	require.Len(t, rep.bounds, len(rep.arms))
	u := figures(rep.unlimited)
	assert.Positive(t, u.hits)
	for i, a := range append([]armResult{rep.unlimited}, rep.arms...) {
		f := figures(a)
		assert.Equal(t, len(rep.unlimited.turns), f.turns, "the same sessions in every arm")
		assert.Zero(t, f.wrong, a.spec.name)
		assert.Zero(t, f.failed, a.spec.name)
		assert.Zero(t, f.unanswered, a.spec.name)
		assert.GreaterOrEqual(t, f.computed, u.computed, "unlimited memory recomputes least: %s", a.spec.name)
		require.NotEmpty(t, a.samples, a.spec.name)
		for _, s := range a.samples {
			for k := range s.used {
				assert.LessOrEqual(t, s.held[k], s.used[k])
				assert.LessOrEqual(t, s.used[k], a.spec.capacity, "the simulator holds no more than its capacity")
			}
		}
		for k, tn := range a.turns {
			if tn.tool {
				require.Less(t, k+1, len(a.turns))
				assert.Equal(t, tn.session, a.turns[k+1].session, "a tool call is answered by the next turn")
			}
		}
		if i == 0 {
			continue
		}
		b := rep.bounds[i-1]
		assert.GreaterOrEqual(t, b.bound, f.reused, "the bound is at least the arm's reuse: %s", a.spec.name)
		assert.GreaterOrEqual(t, b.bound, b.schedule, a.spec.name)
		assert.LessOrEqual(t, b.bound, b.reusable, a.spec.name)
		assert.Equal(t, rep.capacity, a.spec.capacity)
	}
	// spread over 2 replicas, each turn goes to the other one: a hit is a
	// hold the other replica retained, found in the shared Store
	crossHits := 0
	for _, tn := range rep.arm(false, 2).turns {
		require.Equal(t, (tn.session+tn.turn)%2, tn.replica)
		if tn.hit && tn.turn > 0 {
			crossHits++
		}
	}
	assert.Positive(t, crossHits)
	assert.Len(t, rep.arm(true, 2).gaps, 1, "the managed replicas share one ledger")

	var out bytes.Buffer
	printFleet(&out, rep)
	for _, want := range []string{"unlimited, 2 replicas", "hold everything, 2 replicas", "managed, 2 replicas", "managed, 1 replica",
		"TTFT p50 / p99", "prompt tokens recomputed", "reused, of the offline bound", "offline bound at this memory",
		"samples in use over budget", "D: legs queued / preemptions", "tool calls unanswered", "releases by reason",
		"met      every answer in every arm equals a single engine's", "reused tokens at least 85% of the offline bound's",
		"within 3% of 1 replica on reused tokens", "share one 4096-token system prompt", "prefix caching on P on",
		"the managed replicas share one ledger", "managed, 2 replicas, one ledger: gap model learned"} {
		assert.Contains(t, out.String(), want)
	}
	t.Log(out.String())

	// a wrong answer fails the command; a target not met only with --check
	rep.cfg.svg = filepath.Join(t.TempDir(), "fleet.svg")
	assert.NoError(t, reportFleet(io.Discard, rep))
	assert.FileExists(t, rep.cfg.svg, "the chart is written before the verdict")
	rep.arms[1].turns[0].wrong = true
	assert.Equal(t, 1, printFleet(io.Discard, rep))
	assert.ErrorContains(t, reportFleet(io.Discard, rep), "1 targets FAILed")
	rep.arms[1].turns[0].wrong = false
	rep.cfg.svg = ""
	rep.cfg.check = true
	notMet := strings.Count(out.String(), "NOT MET")
	assert.Equal(t, notMet, printFleet(io.Discard, rep))

	var svg bytes.Buffer
	require.NoError(t, writeFleetSVG(&svg, rep))
	dec := xml.NewDecoder(bytes.NewReader(svg.Bytes()))
	for {
		_, err := dec.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		require.NoError(t, err, "the chart is well-formed XML")
	}
	for _, want := range []string{"KV held on the decode engines", "TTFT distribution", "hold everything, 2 replicas: held", "managed budget"} {
		assert.Contains(t, svg.String(), want)
	}
}

// A fleet run repeats exactly for a seed: both arms print the same figures
// twice (the event clock, the releases joining it, no background metrics
// reads).
func TestFleetRepeats(t *testing.T) {
	c := smallFleet(t, "20672", "5", "--compare-one=false")
	var outs [2]string
	for i := range outs {
		rep, err := fleetRun(context.Background(), c, io.Discard)
		require.NoError(t, err)
		assert.Zero(t, rep.arm(true, 2).unsettled)
		var out bytes.Buffer
		printFleet(&out, rep)
		outs[i] = out.String()
	}
	assert.Equal(t, outs[0], outs[1])
	assert.Contains(t, outs[0], "releases by reason (routers)")
}

// A run that outlives its time limit ends with an error, its sessions
// stopped (no goroutine left behind, no race on the results).
func TestFleetTimeout(t *testing.T) {
	c := smallFleet(t, "20672", "4")
	c.timeout = 50 * time.Millisecond
	_, err := fleetRun(context.Background(), c, io.Discard)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}

// --arms managed runs unlimited memory and managed only; --diagnose
// records the routers' release requests, each matched to the turn whose
// hold it released, and prints the classification of what managed kept
// and lost.
func TestFleetDiagnose(t *testing.T) {
	c := smallFleet(t, "half", "10", "--arms", "managed", "--diagnose")
	rep, err := fleetRun(context.Background(), c, io.Discard)
	require.NoError(t, err)
	require.Len(t, rep.arms, 2, "managed with 2 replicas and with 1")
	for _, a := range rep.arms {
		assert.True(t, a.spec.managed)
		byReq := map[string]bool{}
		for _, tn := range a.turns {
			byReq[tn.dReq] = true
		}
		for _, r := range a.releases {
			assert.True(t, byReq[r.dReq], "a release names a turn's decode request")
		}
	}
	assert.NotEmpty(t, rep.arms[0].releases, "holds released under pressure")
	var out bytes.Buffer
	printDiagnosis(&out, rep.arms[0], rep.plan, c.budgetTokens(rep.capacity))
	assert.Contains(t, out.String(), "diagnosis: managed, 2 replicas")
	assert.Contains(t, out.String(), "by wait for: ")
	assert.Contains(t, out.String(), "offline bound with the budget")
	_, err = parseFleetFlags([]string{"--fleet", "--arms", "some"}, io.Discard)
	assert.ErrorContains(t, err, "--arms")
}

// The CPU tier head-to-head on a small fleet: six arms, every answer a
// single engine's; plain P/D reuses nothing from D and holds nothing;
// the CPU-tier-only arm holds nothing for long and loads from D's tiers;
// the combined arm loads from both D's holds and D's tiers; GPU holds
// only never asks a tier; the table and the targets are printed.
func TestFleetCPUTier(t *testing.T) {
	c := smallFleet(t, "half", "10", "--cpu-tier")
	rep, err := fleetTierRun(context.Background(), c, io.Discard)
	require.NoError(t, err)
	require.Len(t, rep.arms, 6)
	var figs []armFigures
	var tf []tierFigures
	for _, a := range rep.arms {
		figs = append(figs, figures(a))
	}
	for i, a := range rep.arms {
		tf = append(tf, tierFiguresOf(a, figs[tierPlain], figs[i]))
		assert.Zero(t, figs[i].wrong, a.spec.name)
		assert.Zero(t, figs[i].failed, a.spec.name)
	}
	assert.Zero(t, figs[tierPlain].reused)
	assert.Zero(t, maxOf(figs[tierPlain].heldPeak), "stock engines hold nothing")
	assert.Zero(t, tf[tierGPU].peerAsked, "GPU holds only never asks a tier")
	assert.Positive(t, tf[tierCPU].peer, "the CPU-tier-only arm loads from D's tiers")
	assert.Zero(t, figs[tierCPU].reused, "and pulls no GPU hold")
	assert.Positive(t, figs[tierBoth].reused+tf[tierBoth].peer)
	assert.Positive(t, rep.holds)
	assert.Equal(t, min(maxOf(figs[tierUnlimited].heldPeak), rep.capacity)/4, rep.holds, "a quarter of what hold everything holds at this capacity")
	var out bytes.Buffer
	printTier(&out, rep)
	for _, want := range []string{"plain P/D", "GPU holds only", "CPU tier only", "both (cost model)", "prefill savings over plain P/D",
		"loaded from D's CPU tier", "both: at least 95% of unlimited memory's prefill savings"} {
		assert.Contains(t, out.String(), want)
	}
	assert.NotContains(t, out.String(), "tail: ")
	// --diagnose: each arm's slowest turns, and what they are made of
	rep.cfg.diagnose = true
	out.Reset()
	printTier(&out, rep)
	assert.Equal(t, len(rep.arms), strings.Count(out.String(), "\ntail: "), "one tail per arm")
	assert.Regexp(t, `tail: unlimited memory.*turns at or above the p99 \(\d+ ms\); means: prompt \d+k tokens`, out.String())
	assert.Regexp(t, `\n  s\d{4}-t\d{2}: TTFT \d+ ms \((P|local|GPU hold|tier pull), D\d\)`, out.String())
	assert.Contains(t, out.String(), "  session ")
	_, err = parseFleetFlags([]string{"--fleet", "--capacity", "peak"}, io.Discard)
	assert.Error(t, err, "--capacity peak only with --cpu-tier")
}
