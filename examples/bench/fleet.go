package main

// Fleet mode: bench --fleet runs hundreds of agent sessions through
// kvroute router replicas sharing one Store, on simulated engines
// (kvroutetest, with KV capacity and vLLM's defaults: prefix caching on)
// on an event clock (kvroutetest.EventClock: modelled time, repeatable for
// a seed), in arms with the same sessions: unlimited decode memory (the
// reference for what reuse can save), hold everything (every retained
// handle held on D for the TTL, the router without decode memory
// management) and managed (kvroute.DecodeMemory's budget, releases and
// placement; the replicas share one ledger, or keep one each with --ledger
// per-replica), each with --replicas routers and, for comparison, with one;
// and the offline bound (fleetbound.go): the most any release policy could
// reuse at this memory, knowing every future arrival.
//
//	go run ./examples/bench --fleet --cpu-tier [--replicas 4] [--capacity half|ample|TOKENS]   (fleettier.go)
//	go run ./examples/bench --fleet [--replicas 4] [--ledger shared|per-replica] [--capacity half|ample|TOKENS] [--sessions 300] [--seed 1] [--svg fleet.svg] [--quick]
//
// --capacity half (the default) sizes the decode engines at half of the
// unlimited arm's mean KV demand on each decode engine (holds and running
// requests, time-averaged over the run): holding everything for the TTL
// does not fit. --capacity ample runs every arm with the node's capacity,
// where managed must change nothing. The targets are printed as met / NOT
// MET lines; a wrong answer or a failed turn makes the command exit
// non-zero, and so does a target not met with --check.

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/internal/durflag"
	"github.com/bidikv/bidikv/kvroute"
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
	toolShare       float64
	sharedShare     float64 // sessions with the common system prompt
	noPrefixCache   bool    // prefill engines without prefix caching
	replicas        int
	spread          bool // a session's turns spread over the replicas; else pinned
	perReplica      bool // each managed replica keeps a ledger of its own; else one for all
	compareOne      bool // also run hold everything and managed with one replica
	timeout         time.Duration
	diagnose        bool    // print where managed lost reuse against every hold's value
	managedOnly     bool    // --arms managed: unlimited memory and managed only
	cpuTier         bool    // --cpu-tier: the CPU tier head-to-head (fleettier.go)
	tierFactor      float64 // --tier-factor: each engine's CPU tier, in multiples of its KV capacity
}

// quickFlags are --quick's sizes: a run of seconds exercising every arm
// and the bound (flags given explicitly win).
var quickFlags = map[string]string{"sessions": "24", "window": "2m", "max-turns": "8", "max-prompt": "30000", "prefill": "1"}

func parseFleetFlags(args []string, help io.Writer) (fleetConfig, error) {
	var c fleetConfig
	var routing, ledger string
	var quick bool
	fs := newFlagSet("bench --fleet")
	fs.Bool("fleet", true, "fleet mode")
	fs.IntVar(&c.sessions, "sessions", 300, "agent sessions")
	fs.DurationVar(&c.window, "window", 20*time.Minute, "sessions start uniformly over this much modelled time")
	fs.IntVar(&c.prefill, "prefill", 2, "prefill engines")
	fs.IntVar(&c.decode, "decode", 2, "decode engines")
	fs.StringVar(&c.profileName, "profile", "qwen3-32b", "engine profile (qwen3-32b or glm-5-fp8)")
	fs.StringVar(&c.capacity, "capacity", "half", "decode KV capacity per engine: half (of the unlimited arm's mean demand), ample (the profile's node), peak (with --cpu-tier: what unlimited memory uses at its peak), or tokens")
	fs.Float64Var(&c.budget, "budget", defaultBudget, "managed arm: the share of each decode engine's capacity its holds may take")
	fs.Float64Var(&c.headroom, "headroom", 0, "managed arm: the share of each decode engine's capacity kept free of holds when a decode leg arrives (kvroute.DecodeMemory.Headroom; 0: its default, negative: no room made on arrival)")
	fs.Uint64Var(&c.seed, "seed", 1, "seed of the sessions")
	fs.DurationVar(&c.sample, "sample", 10*time.Second, "modelled time between samples of the decode engines' KV")
	fs.IntVar(&c.maxTurns, "max-turns", 40, "turns per session at most")
	fs.IntVar(&c.maxPrompt, "max-prompt", 120000, "a session ends before its prompt passes this many tokens")
	fs.StringVar(&c.svg, "svg", "", "write the chart (KV held over time, TTFT distribution) here")
	fs.BoolVar(&c.metrics, "metrics", false, "managed arm: the routers read the decode engines' /metrics in real time (placement by pressure); the run then no longer repeats exactly")
	fs.Float64Var(&c.toolShare, "tool-share", toolShare, "the simulated model's tool call rate: the share of the replies under tool_choice auto that call the tool, decided from each reply (their next turn comes after seconds; the others are read by a person)")
	fs.Float64Var(&c.sharedShare, "shared-system", sharedShare, fmt.Sprintf("the share of sessions whose system prompt is one common prompt of %d tokens", sharedSystemTokens))
	fs.BoolVar(&c.noPrefixCache, "no-prefix-caching", false, "prefill engines without prefix caching (vLLM's --no-enable-prefix-caching; the default is vLLM's: on)")
	fs.IntVar(&c.replicas, "replicas", 4, "router replicas sharing one Store")
	fs.StringVar(&routing, "replica-routing", "spread", "how sessions reach the replicas: spread (each turn to the next replica) or pinned (a session to one)")
	fs.StringVar(&ledger, "ledger", "shared", "managed arm: the replicas' decode memory ledger: shared (one kvroute.DecodeMemory.Ledger for every replica) or per-replica (each its own, budgeting its own holds against whole engines)")
	fs.BoolVar(&c.compareOne, "compare-one", true, "with --replicas above 1, also run hold everything and managed with one router")
	fs.BoolVar(&quick, "quick", false, "a small fleet (24 sessions over 2 minutes, 8 turns, 30k-token prompts, 1 prefill engine): seconds, every arm and the bound")
	fs.BoolVar(&c.check, "check", false, "exit non-zero when a target is not met (a wrong answer always does)")
	fs.DurationVar(&c.timeout, "timeout", 30*time.Minute, "real time limit per arm")
	fs.BoolVar(&c.diagnose, "diagnose", false, "print where each managed arm lost reuse: its holds by what they waited for, size, pause, prefill engine, and its releases; with --cpu-tier, each arm's slowest 1% of turns (the TTFT's parts) and the slowest turn's session")
	fs.BoolVar(&c.cpuTier, "cpu-tier", false, "the CPU tier head-to-head: every engine with a CPU tier twice its KV capacity; plain P/D, GPU holds only (a quarter of hold-everything's), the decode engines' CPU tier only, and both, against unlimited memory")
	fs.Float64Var(&c.tierFactor, "tier-factor", defaultTierFactor, "with --cpu-tier: each engine's CPU tier as a multiple of its KV capacity")
	var arms string
	fs.StringVar(&arms, "arms", "all", "the arms to run: all, or managed (unlimited memory, which sizes the capacity, and managed only: faster)")
	if err := fs.Parse(args); err != nil {
		return c, flagError(fs, err, help)
	}
	if quick {
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		for name, v := range quickFlags {
			if !set[name] {
				if err := fs.Set(name, v); err != nil {
					return c, err
				}
			}
		}
	}
	c.managedOnly = arms == "managed"
	if arms != "all" && arms != "managed" {
		return c, fmt.Errorf("--arms %q: want all or managed", arms)
	}
	c.spread = routing == "spread"
	if routing != "spread" && routing != "pinned" {
		return c, fmt.Errorf("--replica-routing %q: want spread or pinned", routing)
	}
	c.perReplica = ledger == "per-replica"
	if ledger != "shared" && ledger != "per-replica" {
		return c, fmt.Errorf("--ledger %q: want shared or per-replica", ledger)
	}
	if c.replicas < 1 || c.replicas > 64 {
		return c, errors.New("--replicas must be in [1, 64]")
	}
	if !(c.sharedShare >= 0 && c.sharedShare <= 1) {
		return c, errors.New("--shared-system must be in [0, 1]")
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
	if !(c.tierFactor > 0 && c.tierFactor <= 16) {
		return c, errors.New("--tier-factor must be in (0, 16]")
	}
	if c.capacity == "peak" && !c.cpuTier {
		return c, errors.New("--capacity peak: only with --cpu-tier")
	}
	if c.capacity != "half" && c.capacity != "ample" && c.capacity != "peak" {
		n, err := strconv.Atoi(c.capacity)
		if err != nil || n < c.maxPrompt+replyMax+callRoom+kvroutetest.DefaultBlockSize {
			return c, fmt.Errorf("--capacity %q: want half, ample, or tokens above --max-prompt", c.capacity)
		}
	}
	return c, nil
}

// fleetReport is a fleet run's arms.
type fleetReport struct {
	cfg       fleetConfig
	plan      []sessionPlan
	unlimited armResult // hold everything with the node's capacity: the reference
	demand    int       // its mean KV tokens in use per decode engine
	capacity  int       // per decode engine, in the other arms
	ample     bool
	// arms: hold everything and managed with cfg.replicas routers, then
	// (compareOne) with one
	arms   []armResult
	bounds []fleetBound // the offline bound on each arm's recorded arrivals
}

// arm returns the arm of that kind and replica count, nil when not run.
func (r *fleetReport) arm(managed bool, replicas int) *armResult {
	for i := range r.arms {
		if a := &r.arms[i]; a.spec.managed == managed && a.spec.replicas == replicas {
			return a
		}
	}
	return nil
}

func runFleet(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parseFleetFlags(args, stdout)
	if err != nil {
		return err
	}
	if c.cpuTier {
		rep, err := fleetTierRun(ctx, c, progressOut(stderr))
		if err != nil {
			return err
		}
		if fails := printTier(stdout, rep); fails > 0 {
			return fmt.Errorf("%d targets FAILed", fails)
		}
		return nil
	}
	rep, err := fleetRun(ctx, c, progressOut(stderr))
	if err != nil {
		return err
	}
	return reportFleet(stdout, rep)
}

// reportFleet prints the run and writes its chart; a wrong answer, or
// with --check a target not met, is an error (the command exits
// non-zero).
func reportFleet(stdout io.Writer, rep fleetReport) error {
	c := rep.cfg
	fails := printFleet(stdout, rep)
	if c.diagnose {
		for _, a := range rep.arms {
			if a.spec.managed {
				printDiagnosis(stdout, a, rep.plan, c.budgetTokens(rep.capacity))
			}
		}
	}
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
	rep := fleetReport{cfg: c, plan: planFleet(c.seed, c.sessions, c.window, c.maxTurns, c.maxPrompt, c.sharedShare)}
	ample := c.prof.KVCapacityTokens / kvroutetest.DefaultBlockSize * kvroutetest.DefaultBlockSize
	run := func(name string, managed bool, capacity, replicas int) (armResult, error) {
		name = fmt.Sprintf("%s, %d %s", name, replicas, plural(replicas, "replica"))
		spec := armSpec{name: name, managed: managed, capacity: capacity, replicas: replicas, done: new(atomic.Int64)}
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
	var err error
	if rep.unlimited, err = run("unlimited memory (hold everything, the node's capacity)", false, ample, c.replicas); err != nil {
		return rep, err
	}
	rep.demand = meanDemand(rep.unlimited)
	switch c.capacity {
	case "ample":
		rep.ample, rep.capacity = true, ample
	case "half":
		rep.capacity = max(rep.demand/2/kvroutetest.DefaultBlockSize*kvroutetest.DefaultBlockSize,
			c.maxPrompt+replyMax+callRoom+kvroutetest.DefaultBlockSize)
	default:
		rep.capacity, _ = strconv.Atoi(c.capacity)
	}
	counts := []int{c.replicas}
	if c.replicas > 1 && c.compareOne {
		counts = append(counts, 1)
	}
	for _, n := range counts {
		for _, managed := range []bool{false, true} {
			if !managed && c.managedOnly {
				continue
			}
			if !managed && rep.ample && n == c.replicas {
				h := rep.unlimited // the same arm: hold everything with the node's capacity
				rep.arms = append(rep.arms, h)
				continue
			}
			name := "hold everything"
			if managed {
				name = "managed"
			}
			a, err := run(name, managed, rep.capacity, n)
			if err != nil {
				return rep, err
			}
			rep.arms = append(rep.arms, a)
		}
	}
	for _, a := range rep.arms {
		rep.bounds = append(rep.bounds, offlineBound(a, rep.plan, rep.capacity, retentionTTL))
	}
	return rep, nil
}

func plural(n int, s string) string {
	if n == 1 {
		return s
	}
	return s + "s"
}

// retentionTTL is the routers' retention TTL (kvroute's default).
var retentionTTL = kvroute.Defaults().TTLs.Retention

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
