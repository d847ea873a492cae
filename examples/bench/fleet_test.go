package main

import (
	"bytes"
	"context"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// smallFleet is a fleet of a few seconds of CPU: short prompts, a small
// decode capacity.
func smallFleet(t *testing.T, capacity, sessions string) fleetConfig {
	t.Helper()
	c, err := parseFleetFlags([]string{"--fleet", "--sessions", sessions, "--window", "1m", "--max-turns", "5",
		"--max-prompt", "20000", "--capacity", capacity, "--prefill", "1", "--decode", "2", "--timeout", "8m"}, io.Discard)
	require.NoError(t, err)
	return c
}

// The fleet's structural invariants: both arms run the same sessions,
// every answer equals a single engine's, the decode engines never hold
// more than their capacity, and every figure is printed.
func TestFleetSmall(t *testing.T) {
	c := smallFleet(t, "half", "8")
	rep, err := fleetRun(context.Background(), c, io.Discard)
	require.NoError(t, err)
	require.NotNil(t, rep.first)
	assert.Positive(t, rep.demand)
	for _, a := range []armResult{*rep.first, rep.hold, rep.managed} {
		f := figures(a)
		assert.Equal(t, len(a.turns), f.turns)
		assert.Zero(t, f.wrong, a.spec.name)
		assert.Zero(t, f.failed, a.spec.name)
		assert.Positive(t, f.hits, a.spec.name)
		require.NotEmpty(t, a.samples, a.spec.name)
		for _, s := range a.samples {
			for i := range s.used {
				assert.LessOrEqual(t, s.held[i], s.used[i])
				assert.LessOrEqual(t, s.used[i], a.spec.capacity, "the simulator holds no more than its capacity")
			}
		}
	}
	assert.Equal(t, len(rep.hold.turns), len(rep.managed.turns), "the same sessions")
	var out bytes.Buffer
	printFleet(&out, rep)
	for _, want := range []string{"turns per second", "TTFT p50 / p95 / p99", "prompt <8k", "hit rate", "reused prompt tokens",
		"prompt tokens recomputed", "D0 KV held: peak / mean", "D1 KV held", "held within budget", "D: requests queued / preemptions",
		"P: requests queued / preemptions", "releases by reason", "PASS  every answer equals a single engine's"} {
		assert.Contains(t, out.String(), want)
	}
	t.Log(out.String())

	// a FAIL is an error (the command exits non-zero), --check or not
	fails := printFleet(io.Discard, rep)
	rep.cfg.svg = filepath.Join(t.TempDir(), "fleet.svg")
	rep.cfg.check = false
	if err := reportFleet(io.Discard, rep); fails > 0 {
		assert.ErrorContains(t, err, "targets FAILed")
	} else {
		assert.NoError(t, err)
	}
	assert.FileExists(t, rep.cfg.svg, "the chart is written before the verdict")
	rep.managed.turns[0].wrong = true // a wrong answer is a FAIL
	assert.Equal(t, fails+1, printFleet(io.Discard, rep))
	assert.ErrorContains(t, reportFleet(io.Discard, rep), fmt.Sprintf("%d targets FAILed", fails+1))
	rep.managed.turns[0].wrong = false
	rep.cfg.svg = ""

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
	for _, want := range []string{"KV held on the decode engines", "TTFT distribution", "hold everything: held", "managed budget"} {
		assert.Contains(t, svg.String(), want)
	}
}

// A fleet run repeats exactly for a seed: both arms print the same figures
// twice (the event clock, the releases joining it, no background metrics
// reads).
func TestFleetRepeats(t *testing.T) {
	c := smallFleet(t, "20672", "5")
	var outs [2]string
	for i := range outs {
		rep, err := fleetRun(context.Background(), c, io.Discard)
		require.NoError(t, err)
		assert.Zero(t, rep.managed.unsettled)
		var out bytes.Buffer
		printFleet(&out, rep)
		outs[i] = out.String()
	}
	assert.Equal(t, outs[0], outs[1])
	assert.Contains(t, outs[0], "releases by reason (router)")
}

// A run that outlives its time limit ends with an error, its sessions
// stopped (no goroutine left behind, no race on the results).
func TestFleetTimeout(t *testing.T) {
	c := smallFleet(t, "20672", "4")
	c.timeout = 50 * time.Millisecond
	_, err := fleetRun(context.Background(), c, io.Discard)
	require.ErrorIs(t, err, context.DeadlineExceeded)
}
