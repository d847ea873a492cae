package main

// Fleet mode: bench --fleet runs hundreds of agent sessions through a
// kvroute router on simulated engines (kvroutetest, with KV capacity) on
// an event clock (kvroutetest.EventClock: modelled time, repeatable for a
// seed), in two arms with the same sessions: hold everything (every
// retained handle held on D for the TTL, the router without decode memory
// management) and managed (kvroute.DecodeMemory's budget, releases and
// placement).
//
//	go run ./examples/bench --fleet [--capacity half|ample|TOKENS] [--sessions 300] [--seed 1] [--svg fleet.svg] [--clairvoyant]
//
// --capacity half (the default) first runs hold everything with ample
// capacity (the profile's node) to measure its mean KV demand on each
// decode engine (holds and running requests, time-averaged over the run),
// then runs both arms with half of it per decode engine: holding
// everything for the TTL does not fit. --capacity ample runs both arms
// with the node's capacity, where managed must change nothing. The
// decode memory targets are printed as PASS/FAIL lines; a FAIL makes the
// command exit non-zero.

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/internal/durflag"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

type fleetConfig struct {
	sessions        int
	window          time.Duration
	prefill, decode int
	profileName     string
	prof            kvroutetest.Profile
	capacity        string // half, ample, or tokens per decode engine
	budget          float64
	headroom        float64
	seed            uint64
	sample          time.Duration
	maxTurns        int
	maxPrompt       int
	svg             string
	check           bool
	metrics         bool
	clairvoyant     bool
	toolShare       float64
	timeout         time.Duration
}

func parseFleetFlags(args []string, help io.Writer) (fleetConfig, error) {
	var c fleetConfig
	fs := newFlagSet("bench --fleet")
	fs.Bool("fleet", true, "fleet mode")
	fs.IntVar(&c.sessions, "sessions", 300, "agent sessions")
	fs.DurationVar(&c.window, "window", 20*time.Minute, "sessions start uniformly over this much modelled time")
	fs.IntVar(&c.prefill, "prefill", 2, "prefill engines")
	fs.IntVar(&c.decode, "decode", 2, "decode engines")
	fs.StringVar(&c.profileName, "profile", "qwen3-32b", "engine profile (qwen3-32b or glm-5-fp8)")
	fs.StringVar(&c.capacity, "capacity", "half", "decode KV capacity per engine: half (of hold everything's mean demand, measured by a first run), ample (the profile's node), or tokens")
	fs.Float64Var(&c.budget, "budget", defaultBudget, "managed arm: the share of each decode engine's capacity its holds may take")
	fs.Float64Var(&c.headroom, "headroom", 0, "managed arm: the share of each decode engine's capacity kept free of holds when a decode leg arrives (kvroute.DecodeMemory.Headroom; 0: its default, negative: no room made on arrival)")
	fs.Uint64Var(&c.seed, "seed", 1, "seed of the sessions")
	fs.DurationVar(&c.sample, "sample", 10*time.Second, "modelled time between samples of the decode engines' KV")
	fs.IntVar(&c.maxTurns, "max-turns", 40, "turns per session at most")
	fs.IntVar(&c.maxPrompt, "max-prompt", 120000, "a session ends before its prompt passes this many tokens")
	fs.StringVar(&c.svg, "svg", "", "write the chart (KV held over time, TTFT distribution) here")
	fs.BoolVar(&c.metrics, "metrics", false, "managed arm: the router reads the decode engines' /metrics (placement by pressure); the run then no longer repeats exactly")
	fs.Float64Var(&c.toolShare, "tool-share", toolShare, "the simulated model's tool call rate: the share of the replies under tool_choice auto that call the tool, decided from each reply (their next turn comes after seconds; the others are read by a person)")
	fs.BoolVar(&c.clairvoyant, "clairvoyant", false, "managed arm: release the holds whose next turn comes last (known from the plan, as no router can): an upper bound on the choice of victims")
	fs.BoolVar(&c.check, "check", true, "exit non-zero when a target FAILs (always; accepted for older command lines)")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Minute, "real time limit per arm")
	if err := fs.Parse(args); err != nil {
		return c, flagError(fs, err, help)
	}
	if err := durflag.Check(fs, args, "sample", "timeout"); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	var ok bool
	if c.prof, ok = kvroutetest.LookupProfile(c.profileName); !ok || c.prof.KVCapacityTokens == 0 {
		return c, fmt.Errorf("--profile %q: want qwen3-32b or glm-5-fp8", c.profileName)
	}
	switch {
	case c.sessions < 1 || c.prefill < 1 || c.decode < 1 || c.maxTurns < 1:
		return c, errors.New("--sessions, --prefill, --decode and --max-turns must be at least 1")
	case c.budget <= 0 || c.budget > 1:
		return c, errors.New("--budget must be in (0, 1]")
	case !(c.toolShare >= 0 && c.toolShare <= 1):
		return c, errors.New("--tool-share must be in [0, 1]")
	case c.maxPrompt < 20000 || c.maxPrompt > c.prof.KVCapacityTokens:
		return c, fmt.Errorf("--max-prompt must be in [20000, %d]", c.prof.KVCapacityTokens)
	}
	if c.capacity != "half" && c.capacity != "ample" {
		n, err := strconv.Atoi(c.capacity)
		if err != nil || n < c.maxPrompt+replyMax+callRoom+kvroutetest.DefaultBlockSize {
			return c, fmt.Errorf("--capacity %q: want half, ample, or tokens above --max-prompt", c.capacity)
		}
	}
	return c, nil
}

// fleetReport is a fleet run's arms.
type fleetReport struct {
	cfg      fleetConfig
	plan     []sessionPlan
	first    *armResult // hold everything with ample capacity (--capacity half)
	demand   int        // its mean KV tokens in use per decode engine
	capacity int        // per decode engine, in the arms
	ample    bool
	hold     armResult
	managed  armResult
}

func runFleet(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parseFleetFlags(args, stdout)
	if err != nil {
		return err
	}
	rep, err := fleetRun(ctx, c, progressOut(stderr))
	if err != nil {
		return err
	}
	return reportFleet(stdout, rep)
}

// reportFleet prints the run and writes its chart; a FAIL is an error
// (the command exits non-zero).
func reportFleet(stdout io.Writer, rep fleetReport) error {
	c := rep.cfg
	fails := printFleet(stdout, rep)
	if c.svg != "" {
		f, err := os.Create(c.svg)
		if err != nil {
			return err
		}
		if err := writeFleetSVG(f, rep); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "chart: %s\n", c.svg)
	}
	if fails > 0 {
		return fmt.Errorf("%d targets FAILed", fails)
	}
	return nil
}

// fleetRun runs the arms the configuration asks for.
func fleetRun(ctx context.Context, c fleetConfig, progress io.Writer) (fleetReport, error) {
	rep := fleetReport{cfg: c, plan: planFleet(c.seed, c.sessions, c.window, c.maxTurns, c.maxPrompt)}
	ample := c.prof.KVCapacityTokens / kvroutetest.DefaultBlockSize * kvroutetest.DefaultBlockSize
	run := func(name string, managed bool, capacity int) (armResult, error) {
		spec := armSpec{name: name, managed: managed, capacity: capacity, done: new(atomic.Int64)}
		start := time.Now()
		stop := every(progress, progressInterval, func() string {
			return fmt.Sprintf("fleet: %s: %d of %d sessions done, %s real time", name, spec.done.Load(), len(rep.plan),
				time.Since(start).Round(time.Second))
		})
		a, err := runArm(ctx, c, rep.plan, spec)
		stop()
		if err == nil {
			fmt.Fprintf(progress, "fleet: %s, capacity %d tokens per decode engine: %d turns in %s real time\n",
				name, capacity, len(a.turns), a.real.Round(time.Millisecond))
		}
		return a, err
	}
	switch c.capacity {
	case "ample":
		rep.ample, rep.capacity = true, ample
	case "half":
		first, err := run("hold everything (first run, ample capacity)", false, ample)
		if err != nil {
			return rep, err
		}
		rep.first = &first
		rep.demand = meanDemand(first)
		rep.capacity = max(rep.demand/2/kvroutetest.DefaultBlockSize*kvroutetest.DefaultBlockSize,
			c.maxPrompt+replyMax+callRoom+kvroutetest.DefaultBlockSize)
	default:
		rep.capacity, _ = strconv.Atoi(c.capacity)
	}
	var err error
	if rep.hold, err = run("hold everything", false, rep.capacity); err != nil {
		return rep, err
	}
	if rep.managed, err = run("managed", true, rep.capacity); err != nil {
		return rep, err
	}
	return rep, nil
}

// meanDemand is a run's KV tokens in use (holds and running requests) per
// decode engine, averaged over the samples (taken at a fixed modelled
// interval: a mean over time) and the engines.
func meanDemand(a armResult) int {
	sum, n := 0, 0
	for _, s := range a.samples {
		for _, u := range s.used {
			sum += u
			n++
		}
	}
	if n == 0 {
		return 0
	}
	return sum / n
}
