package main

// Replay mode: bench --replay-trace [FILE] replays a Mooncake conversation
// trace (default: the committed copy of Mooncake's FAST'25
// conversation_trace.jsonl, testdata/mooncake) against decode-memory
// policies, without engines: arrivals by timestamp, a request that starts
// with all of an earlier request's full 512-token blocks (at least 2) is
// that conversation's next turn, and a finished request's KV (input and
// output tokens) is held on the decode engine until its next turn uses it
// (a hit reuses what was held, capped by the new prompt's length), or it
// is released, or it expires (TTL 480 s). Only the first extension of a
// request can use its hold (handles are single use). Policies, at budgets
// (caps on held tokens) from 20% to 100% of holding everything's mean:
// hold everything for the TTL; drop the oldest hold first when over the
// cap; a fixed shorter TTL whose mean held equals the budget; and managed,
// retention/budget's victims with its gap model learned as the replay
// goes.
//
//	go run ./examples/bench --replay-trace [FILE] [--budgets 0.2,0.5,1] [--svg bidikv-replay.svg]

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/bidikv/bidikv/internal/durflag"
)

// defaultTrace is the committed copy, from the repository root or from
// examples/bench.
var defaultTraces = []string{
	filepath.Join("examples", "bench", "testdata", "mooncake", "conversation_trace.jsonl.gz"),
	filepath.Join("testdata", "mooncake", "conversation_trace.jsonl.gz"),
}

type replayFlags struct {
	trace   string
	ttl     time.Duration
	budgets []float64
	limit   int
	svg     string
}

func parseReplayFlags(args []string, help io.Writer) (replayFlags, error) {
	c := replayFlags{}
	// --replay-trace takes an optional FILE: the next argument unless it
	// is a flag.
	var rest []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		if a == "--replay-trace" || a == "-replay-trace" {
			if i+1 < len(args) && !strings.HasPrefix(args[i+1], "-") {
				c.trace = args[i+1]
				i++
			}
			continue
		}
		if v, ok := strings.CutPrefix(a, "--replay-trace="); ok {
			c.trace = v
			continue
		}
		rest = append(rest, a)
	}
	fs := newFlagSet("bench --replay-trace")
	fs.DurationVar(&c.ttl, "ttl", 480*time.Second, "how long the decode engine holds a finished request's KV (vLLM's decoder_kv_blocks_ttl)")
	budgets := fs.String("budgets", "0.2,0.25,0.333,0.4,0.5,0.6,0.7,0.8,0.9,1", "caps on held tokens, as fractions of holding everything's mean")
	fs.IntVar(&c.limit, "limit", 0, "replay only the first N requests (0: all)")
	fs.StringVar(&c.svg, "svg", "bidikv-replay.svg", "write the chart of reused tokens against held KV here ('' for none)")
	if err := fs.Parse(rest); err != nil {
		return c, flagError(fs, err, help)
	}
	if err := durflag.Check(fs, rest, "ttl"); err != nil {
		return c, err
	}
	if fs.NArg() > 0 {
		return c, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	for _, f := range strings.Split(*budgets, ",") {
		v, err := strconv.ParseFloat(strings.TrimSpace(f), 64)
		if err != nil || v <= 0 || v > 1 {
			return c, fmt.Errorf("--budgets %q: want fractions in (0, 1]", f)
		}
		c.budgets = append(c.budgets, v)
	}
	if c.limit < 0 {
		return c, errors.New("--limit must not be negative")
	}
	if c.trace == "" {
		for _, p := range defaultTraces {
			if _, err := os.Stat(p); err == nil {
				c.trace = p
				break
			}
		}
		if c.trace == "" {
			return c, fmt.Errorf("no trace given and the committed copy is not at %s (run from the repository root)", defaultTraces[0])
		}
	}
	return c, nil
}

// replayReport is a replay's results: the reference and, per budget, each
// capped policy.
type replayReport struct {
	requests int
	all      outcome
	rows     []budgetRow
}

type budgetRow struct {
	fraction float64
	cap      int64
	drop     outcome
	ttl      outcome // the fixed TTL whose mean held is the cap
	managed  outcome
	sameTTL  outcome // the fixed TTL whose mean held is managed's
	costly   outcome // managed, hits valued by the default cost model
	oracle   outcome // a cap with knowledge of the future: the bound
}

func runReplay(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parseReplayFlags(args, stdout)
	if err != nil {
		return err
	}
	tr, err := loadTrace(c.trace, c.limit)
	if err != nil {
		return err
	}
	rep, err := replayAll(ctx, tr, c.ttl.Seconds(), c.budgets, progressOut(stderr))
	if err != nil {
		return err
	}
	printReplay(stdout, c, tr, rep)
	if c.svg != "" {
		f, err := os.Create(c.svg)
		if err != nil {
			return err
		}
		if err := writeReplaySVG(f, filepath.Base(c.trace), rep); err != nil {
			f.Close()
			return err
		}
		if err := f.Close(); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "chart: %s\n", c.svg)
	}
	return nil
}

// replayAll runs every policy at every budget.
func replayAll(ctx context.Context, tr *trace, ttl float64, budgets []float64, stderr io.Writer) (replayReport, error) {
	rep := replayReport{requests: len(tr.reqs)}
	var err error
	if rep.all, err = replay(tr, replayConfig{policy: holdAll, ttl: ttl}, nil); err != nil {
		return rep, err
	}
	for _, f := range budgets {
		if err := ctx.Err(); err != nil {
			return rep, err
		}
		row := budgetRow{fraction: f, cap: int64(f * rep.all.mean)}
		if row.drop, err = replay(tr, replayConfig{policy: dropOldest, ttl: ttl, cap: row.cap}, nil); err != nil {
			return rep, err
		}
		if row.ttl, err = tuneTTL(tr, ttl, float64(row.cap)); err != nil {
			return rep, err
		}
		if row.managed, err = replay(tr, replayConfig{policy: managed, ttl: ttl, cap: row.cap, saved: tokenSeconds}, nil); err != nil {
			return rep, err
		}
		if row.sameTTL, err = tuneTTL(tr, ttl, row.managed.mean); err != nil {
			return rep, err
		}
		if row.costly, err = replay(tr, replayConfig{policy: managed, ttl: ttl, cap: row.cap, saved: savedSeconds}, nil); err != nil {
			return rep, err
		}
		if row.oracle, err = replay(tr, replayConfig{policy: oracle, ttl: ttl, cap: row.cap}, nil); err != nil {
			return rep, err
		}
		fmt.Fprintf(stderr, "replay: budget %.0f%% done\n", 100*f)
		rep.rows = append(rep.rows, row)
	}
	return rep, nil
}

func mtok(v float64) string { return fmt.Sprintf("%.2fM", v/1e6) }

func pct(a, b float64) string {
	if b == 0 {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*a/b)
}

func printReplay(w io.Writer, c replayFlags, tr *trace, rep replayReport) {
	n := len(tr.reqs)
	dur := tr.reqs[n-1].at() - tr.reqs[0].at()
	fmt.Fprintf(w, "Decode memory: trace replay of %s: %d requests over %s, TTL %v\n",
		filepath.Base(c.trace), n, time.Duration(dur*1e9).Round(time.Second), c.ttl)
	gaps := slices.Clone(tr.gaps)
	slices.Sort(gaps)
	over := 0
	for _, g := range gaps {
		if g > 450 {
			over++
		}
	}
	fmt.Fprintf(w, "%d requests (%.1f%%) extend an earlier prompt; gap to a request's first extension: p10 %.0f s, p50 %.0f s, p90 %.0f s, p99 %.0f s; %.1f%% over 450 s\n",
		tr.extends, 100*float64(tr.extends)/float64(n),
		percentile(gaps, 10), percentile(gaps, 50), percentile(gaps, 90), percentile(gaps, 99), 100*float64(over)/float64(max(len(gaps), 1)))
	within := [2][2]int{} // [extends one][extended within the TTL]
	firstExt := make([]float64, n)
	for i := range firstExt {
		firstExt[i] = -1
	}
	for m, rs := range tr.firsts {
		for _, r := range rs {
			firstExt[r] = tr.reqs[m].at() - tr.reqs[r].at()
		}
	}
	for i := range tr.reqs {
		k := 0
		if tr.turn[i] > 1 {
			k = 1
		}
		within[k][0]++
		if firstExt[i] >= 0 && firstExt[i] < c.ttl.Seconds() {
			within[k][1]++
		}
	}
	fmt.Fprintf(w, "extended within the TTL: %.2f of the requests that extend one, %.2f of first requests\n",
		float64(within[1][1])/float64(max(within[1][0], 1)), float64(within[0][1])/float64(max(within[0][0], 1)))
	a := rep.all
	fmt.Fprintf(w, "hold everything: mean held %s tokens over the trace (%s counting each hold's whole life over the trace's duration, %s of it ending in a reuse), peak %s; reused %s tokens in %d hits\n",
		mtok(a.mean), mtok(a.life), mtok(a.lifeUsed), mtok(float64(a.peak)), mtok(float64(a.reused)), a.hits)
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Reused tokens, share of hold-everything's, at a cap on held tokens (budget: the cap as a share of hold-everything's mean):")
	fmt.Fprintf(w, "%7s %8s %12s %15s %17s %9s %20s %8s\n", "budget", "cap", "drop oldest", "fixed TTL, mean", "fixed TTL, mean", "managed", "managed, cost-model", "oracle")
	fmt.Fprintln(w, strings.TrimRight(fmt.Sprintf("%7s %8s %12s %15s %17s %9s %20s", "", "", "", "= cap", "= managed's", "", "value"), " "))
	for _, r := range rep.rows {
		sh := func(o outcome) string { return pct(float64(o.reused), float64(a.reused)) }
		fmt.Fprintf(w, "%7s %8s %12s %15s %17s %9s %20s %8s\n", fmt.Sprintf("%.0f%%", 100*r.fraction), mtok(float64(r.cap)),
			sh(r.drop), fmt.Sprintf("%s %3.0fs", sh(r.ttl), r.ttl.ttl), fmt.Sprintf("%s %3.0fs", sh(r.sameTTL), r.sameTTL.ttl), sh(r.managed), sh(r.costly), sh(r.oracle))
	}
	fmt.Fprintln(w, "oracle: a cap that knows which holds will be used (the future): the bound no policy without it reaches")
	fmt.Fprintln(w)
	fmt.Fprintf(w, "%7s %8s  %-22s %9s %7s %6s %9s %7s %9s %7s %9s\n",
		"budget", "cap", "policy", "reused", "of all", "hits", "mean", "of cap", "peak", "saved", "released")
	line := func(f, cap, name string, o outcome, capTok int64) {
		fmt.Fprintf(w, "%7s %8s  %-22s %9s %7s %6d %9s %7s %9s %6.0fs %9d\n", f, cap, name,
			mtok(float64(o.reused)), pct(float64(o.reused), float64(a.reused)), o.hits,
			mtok(o.mean), pct(o.mean, float64(capTok)), mtok(float64(o.peak)), o.saved, o.released)
	}
	line("", "", "hold everything", a, 0)
	for _, r := range rep.rows {
		f, cp := fmt.Sprintf("%.0f%%", 100*r.fraction), mtok(float64(r.cap))
		line(f, cp, "drop oldest", r.drop, r.cap)
		line("", "", fmt.Sprintf("fixed TTL %.0fs", r.ttl.ttl), r.ttl, r.cap)
		line("", "", fmt.Sprintf("fixed TTL %.0fs", r.sameTTL.ttl), r.sameTTL, r.cap)
		line("", "", "managed", r.managed, r.cap)
		line("", "", "managed, cost model", r.costly, r.cap)
	}
	fmt.Fprintln(w, "reused: tokens the hits pulled instead of recomputing (of all: share of hold-everything's); mean: held tokens time-averaged over the trace;")
	fmt.Fprintln(w, "a fixed TTL has no cap (its peak may exceed it): the first has the cap as its mean, the second managed's mean; managed values a hit by its tokens")
	fmt.Fprintln(w, "(the replay's objective), \"cost model\" by the prefill seconds it saves in the default cost model (threshold.DefaultRates: attention makes long")
	fmt.Fprintln(w, "contexts dearer per token); saved: those seconds, for every policy; released: holds a cap removed before use or expiry")
	printGaps(w, tr, rep, c.ttl)
	var drop, same, atCap int
	worstPeak := 0.0
	for _, r := range rep.rows {
		if r.managed.reused >= r.drop.reused {
			drop++
		}
		if r.managed.reused >= r.sameTTL.reused {
			same++
		}
		if r.managed.reused >= r.ttl.reused {
			atCap++
		} else {
			worstPeak = max(worstPeak, float64(r.ttl.peak)/float64(r.cap)-1)
		}
	}
	n = len(rep.rows)
	fmt.Fprintf(w, "managed reuses at least as many tokens as: dropping the oldest at %d of %d budgets; the fixed TTL of the same mean memory at %d of %d;\n", drop, n, same, n)
	fmt.Fprintf(w, "the fixed TTL whose mean is the cap at %d of %d", atCap, n)
	if atCap < n {
		fmt.Fprintf(w, " (where it does not, that TTL's peak is up to %.0f%% over the cap)", 100*worstPeak)
	}
	fmt.Fprintln(w)
}

// printGaps compares the gap model the managed policy learned (at the
// budget nearest half) with the trace's own figures.
func printGaps(w io.Writer, tr *trace, rep replayReport, ttl time.Duration) {
	if len(rep.rows) == 0 {
		return
	}
	r := rep.rows[0]
	for _, x := range rep.rows {
		if abs(x.fraction-0.5) < abs(r.fraction-0.5) {
			r = x
		}
	}
	g := r.managed.gaps
	if len(g.Classes) == 0 {
		return
	}
	c := g.Classes[0]
	fmt.Fprintf(w, "gap model learned online (managed at %.0f%%, at the last arrival): next turn within %v (the horizon) %.2f; gap p50 %.0f s, p90 %.0f s, p99 %.0f s\n",
		100*r.fraction, g.Horizon, c.Return, c.P50.Seconds(), c.P90.Seconds(), c.P99.Seconds())
	// The trace's own share extended within the TTL, by turn group.
	type count struct{ n, in int }
	var byGroup [5]count
	firstExt := make([]float64, len(tr.reqs))
	for i := range firstExt {
		firstExt[i] = -1
	}
	for m, rs := range tr.firsts {
		for _, x := range rs {
			firstExt[x] = tr.reqs[m].at() - tr.reqs[x].at()
		}
	}
	for i, t := range tr.turn {
		k := 4
		for j, first := range []int{2, 3, 5, 9} {
			if t < first {
				k = j
				break
			}
		}
		byGroup[k].n++
		if firstExt[i] >= 0 && firstExt[i] < ttl.Seconds() {
			byGroup[k].in++
		}
	}
	var parts []string
	k := 0
	for _, f := range c.Within {
		if f.ToolCalls {
			continue
		}
		turns := fmt.Sprint(f.FirstTurn)
		switch f.LastTurn {
		case 0:
			turns += "+"
		case f.FirstTurn:
		default:
			turns += fmt.Sprintf("-%d", f.LastTurn)
		}
		parts = append(parts, fmt.Sprintf("%s %.2f (trace %.2f)", turns, f.Probability, float64(byGroup[k].in)/float64(max(byGroup[k].n, 1))))
		k++
	}
	fmt.Fprintf(w, "  next turn within %v, by turn number: %s\n", ttl, strings.Join(parts, ", "))
}

func abs(x float64) float64 { return max(x, -x) }
