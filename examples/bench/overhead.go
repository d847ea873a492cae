package main

// Overhead mode: bench --overhead measures what the router adds, with
// engines that cost almost nothing, in separate processes:
//
//	go run ./examples/bench --overhead      (from the repository root)
//
// It builds vllmsim and the proxy, starts a canned prefill and a canned
// decode engine (vllmsim --canned) and two proxies over them (--verification
// content and tokens), and runs closed-loop chat conversations (a system
// message and a user message of --hist bytes, then 8 turns, each adding the
// reply and a short user message) against each proxy and against a direct
// P-then-D chain: the client itself sends the prefill leg to P and the
// decode leg with P's handle to D, the same two round trips with no router,
// the zero-overhead baseline. The canned engines report a KV pool large
// enough for every conversation's handles (cannedPoolBlocks), so that no
// build's hit rate depends on releases for room. For each history size and
// concurrency the
// three targets run one after the other, in a rotating order, --repeats
// times, and the table gives the median over repeats of:
//
//   - added TTFT p50/p99: the proxy run's TTFT percentile minus the direct
//     chain's (TTFT: from sending the turn to the first event with
//     non-empty delta.content);
//   - router CPU per turn: the proxy process's utime+stime
//     (/proc/PID/stat) over the run, divided by its turns;
//   - allocations and bytes allocated per turn: go_memstats_mallocs_total
//     and go_memstats_alloc_bytes_total from the proxy's /metrics;
//   - engine CPU per turn: both canned engines' utime+stime, in token mode
//     their render and toy tokenizing (the engine's share, not the
//     router's);
//   - router busy: the proxy's CPU time over the run's wall time (100% is
//     one core busy all the time);
//   - the hit rate (X-Bidikv-Reuse) and turns per second.
//
// With --compare DIR, the proxy binary in DIR (another build, such as the
// commit before a change) runs as more targets in the same rotation, one
// per mode, over the same engines and conversations: its rows are marked
// with --compare-label, and each row of the build under test gives the
// median over repeats of its router CPU per turn divided by the other
// build's in the same repeat (adjacent runs, so that a shared machine's
// drifting load cancels out).
//
// With --pin-router and --pin-rest (taskset CPU lists) the proxies run on
// CPUs of their own and the engines and the client on the others, so that
// the knee (where turns per second stop growing with concurrency) shows
// which side saturates first: the router (busy near 100% of its CPUs) or
// the engines and their loopback I/O (router busy below, the direct chain
// stopping at the same rate).

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/internal/toytok"
)

type ovhConfig struct {
	repo     string
	hists    []int
	concs    []int
	modes    []string
	repeats  int
	turns    int // turns per run at 10 KB; scaled by 10 KB / hist, at least minTurns
	minTurns int
	bin      string
	// CPU lists for taskset: the proxies on pinRouter, the engines and this
	// client on pinRest (both empty: no pinning).
	pinRouter, pinRest string
	// compare is a directory with another build's proxy, run as more
	// targets labelled compareLabel ("" : none).
	compare, compareLabel string
}

func parseOverheadFlags(args []string, help io.Writer) (ovhConfig, error) {
	c := ovhConfig{}
	fs := newFlagSet("bench --overhead")
	fs.Bool("overhead", true, "overhead mode (this mode)")
	fs.StringVar(&c.repo, "repo", ".", "repository root (to build examples/vllmsim and examples/proxy)")
	fs.StringVar(&c.bin, "bin", "", "directory with vllmsim and proxy binaries already built (default: build them into a temporary directory)")
	hists := fs.String("hist", "10KB,100KB", "history sizes (bytes, or with KB)")
	concs := fs.String("conc", "1,64", "client concurrencies")
	modes := fs.String("modes", "content,tokens", "proxy verification modes")
	fs.IntVar(&c.repeats, "repeats", 3, "interleaved repeats of each run")
	fs.IntVar(&c.turns, "turns", 2000, "turns per run with a 10 KB history (scaled down for larger ones)")
	fs.IntVar(&c.minTurns, "min-turns", 500, "turns per run at least (and at least 16 per client)")
	fs.StringVar(&c.pinRouter, "pin-router", "", "CPUs (a taskset list) for the proxies; needs --pin-rest: the engines and the client run there, so that the router has cores of its own and the knee shows which side saturates")
	fs.StringVar(&c.pinRest, "pin-rest", "", "CPUs (a taskset list) for the engines and this client, with --pin-router")
	fs.StringVar(&c.compare, "compare", "", "directory with another build's proxy binary (such as the commit before a change), run in the same rotation over the same engines, for side-by-side rows and per-repeat CPU ratios")
	fs.StringVar(&c.compareLabel, "compare-label", "compare", "label of the --compare build's rows")
	if err := fs.Parse(args); err != nil {
		return c, flagError(fs, err, help)
	}
	for _, h := range strings.Split(*hists, ",") {
		h = strings.TrimSpace(h)
		mult := 1
		if n, ok := strings.CutSuffix(strings.ToUpper(h), "KB"); ok {
			h, mult = n, 1024
		}
		n, err := strconv.Atoi(h)
		if err != nil || n <= 0 {
			return c, fmt.Errorf("--hist %q: want sizes such as 10KB", *hists)
		}
		c.hists = append(c.hists, n*mult)
	}
	for _, s := range strings.Split(*concs, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return c, fmt.Errorf("--conc %q: want positive integers", *concs)
		}
		c.concs = append(c.concs, n)
	}
	for _, m := range strings.Split(*modes, ",") {
		m = strings.TrimSpace(m)
		if m != "content" && m != "tokens" {
			return c, fmt.Errorf("--modes %q: use content and/or tokens", *modes)
		}
		c.modes = append(c.modes, m)
	}
	if (c.pinRouter == "") != (c.pinRest == "") {
		return c, errors.New("--pin-router and --pin-rest go together")
	}
	if c.repeats < 1 || c.turns < 1 {
		return c, errors.New("--repeats and --turns must be at least 1")
	}
	return c, nil
}

// cannedPoolBlocks is the KV pool the canned engines report: room for
// four times the handles of the largest run's conversations (a history of
// h bytes is about h/4 toy tokens, h/64 blocks of 16, plus the turns'
// growth), and never below the canned handles' id range. A router releases
// held handles for room when its engines' pool is full; a pool too small
// for the run would make the hit rate depend on how the builds' turns
// interleave rather than on the router, and skew the comparison.
func cannedPoolBlocks(c ovhConfig) int {
	return max(toytok.PoolBlocks, 4*slices.Max(c.concs)*(slices.Max(c.hists)/64+1024))
}

// runOverhead is bench --overhead.
func runOverhead(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parseOverheadFlags(args, stdout)
	if err != nil {
		return err
	}
	stderr = progressOut(stderr) // its lines are progress: on a terminal only
	bin := c.bin
	if bin == "" {
		dir, err := os.MkdirTemp("", "bidikv-overhead-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		fmt.Fprintln(stderr, "overhead: building vllmsim and proxy")
		if err := goBuild(ctx, c.repo, filepath.Join(dir, "vllmsim"), "./examples/vllmsim"); err != nil {
			return err
		}
		if err := goBuild(ctx, filepath.Join(c.repo, "examples", "proxy"), filepath.Join(dir, "proxy"), "."); err != nil {
			return err
		}
		bin = dir
	}
	var procs []*child
	defer func() {
		for _, p := range procs {
			p.stop()
		}
	}()
	if c.pinRest != "" {
		// This process (the client) and every thread it has: new threads
		// inherit the mask.
		out, err := exec.CommandContext(ctx, "taskset", "-a", "-p", "-c", c.pinRest, strconv.Itoa(os.Getpid())).CombinedOutput()
		if err != nil {
			return fmt.Errorf("taskset for the client: %w: %s", err, out)
		}
	}
	start := func(name string, args ...string) (*child, error) {
		path := filepath.Join(bin, name)
		if name == "proxy@" {
			name, path = "proxy", filepath.Join(c.compare, "proxy")
		}
		if cpus := c.pinRest; cpus != "" {
			if name == "proxy" {
				cpus = c.pinRouter
			}
			// taskset execs the program: the PID stays the program's.
			args = append([]string{"-c", cpus, path}, args...)
			path = "taskset"
		}
		p, err := startChild(ctx, path, args...)
		if err == nil {
			procs = append(procs, p)
		}
		return p, err
	}
	pool := strconv.Itoa(cannedPoolBlocks(c))
	pe, err := start("vllmsim", "--canned", "prefill", "--port", "0", "--num-gpu-blocks-override", pool)
	if err != nil {
		return err
	}
	de, err := start("vllmsim", "--canned", "decode", "--port", "0", "--num-gpu-blocks-override", pool)
	if err != nil {
		return err
	}
	proxies := map[string]*child{}
	targets := []string{"direct"}
	for _, build := range []string{"proxy", "proxy@"} {
		if build == "proxy@" && c.compare == "" {
			break
		}
		for _, m := range c.modes {
			p, err := start(build, "--port", "0", "--prefill", pe.url, "--decode", de.url, "--verification", m,
				"--log-level", "error", "--health-interval", "1m")
			if err != nil {
				return err
			}
			tg := m
			if build == "proxy@" {
				tg = m + "@" + c.compareLabel
			}
			proxies[tg] = p
			targets = append(targets, tg)
		}
	}
	client := &http.Client{Transport: &http.Transport{MaxIdleConnsPerHost: 1024, DisableCompression: true}}
	defer client.CloseIdleConnections()

	loadStart := loadAvg()
	fmt.Fprintf(stdout, "overhead: %d repeats, load average at start %s, %s\n", c.repeats, loadStart, cpuLine())
	if c.pinRouter != "" {
		fmt.Fprintf(stdout, "pinned: proxies on CPUs %s, engines and client on CPUs %s\n", c.pinRouter, c.pinRest)
	}
	type key struct {
		target     string
		hist, conc int
	}
	results := map[key][]ovhRun{}
	for rep := range c.repeats {
		for _, hist := range c.hists {
			for _, conc := range c.concs {
				// At least two conversations a client, so that the hit rate
				// nears 7/8.
				turns := max(c.minTurns, c.turns*(10<<10)/hist, 16*conc)
				// Rotate the order from one repeat to the next.
				k := rep % len(targets)
				order := append(slices.Clone(targets[k:]), targets[:k]...)
				for _, tg := range order {
					var r ovhRun
					var err error
					if tg == "direct" {
						r, err = measure(ctx, client, nil, pe, de, hist, conc, turns, fmt.Sprintf("r%d-direct", rep))
					} else {
						r, err = measure(ctx, client, proxies[tg], pe, de, hist, conc, turns, fmt.Sprintf("r%d-%s", rep, tg))
					}
					if err != nil {
						return fmt.Errorf("%s hist=%d conc=%d: %w", tg, hist, conc, err)
					}
					fmt.Fprintf(stderr, "overhead: repeat %d %-7s hist=%dKB conc=%d: ttft p50 %.3f ms, %.0f turns/s, router %.3f ms/turn\n",
						rep+1, tg, hist>>10, conc, r.p50, r.rate, r.routerCPU)
					results[key{tg, hist, conc}] = append(results[key{tg, hist, conc}], r)
				}
			}
		}
	}
	fmt.Fprintf(stdout, "load average at end %s\n\n", loadAvg())
	ratioHead, ratioSep := "", ""
	if c.compare != "" {
		ratioHead, ratioSep = " CPU/turn vs "+c.compareLabel+" |", "---|"
	}
	fmt.Fprintln(stdout, "| mode | history | conc | added TTFT p50 | added TTFT p99 | router CPU/turn | router busy | allocs/turn | alloc/turn (x body) | hit rate | turns/s proxy (direct) | engine CPU/turn proxy (direct) |"+ratioHead)
	fmt.Fprintln(stdout, "|---|---|---|---|---|---|---|---|---|---|---|---|"+ratioSep)
	for _, m := range targets[1:] {
		for _, hist := range c.hists {
			for _, conc := range c.concs {
				px, dr := results[key{m, hist, conc}], results[key{"direct", hist, conc}]
				added50 := make([]float64, len(px))
				added99 := make([]float64, len(px))
				for i := range px {
					added50[i] = px[i].p50 - dr[i].p50
					added99[i] = px[i].p99 - dr[i].p99
				}
				body := med(px, func(r ovhRun) float64 { return r.bodyBytes })
				alloc := med(px, func(r ovhRun) float64 { return r.allocBytes })
				ratio := ""
				if cp, ok := results[key{m + "@" + c.compareLabel, hist, conc}]; ok && c.compare != "" {
					rs := make([]float64, 0, len(px))
					for i := range min(len(px), len(cp)) {
						if cp[i].routerCPU > 0 {
							rs = append(rs, px[i].routerCPU/cp[i].routerCPU)
						}
					}
					ratio = fmt.Sprintf(" %.2f |", median(rs))
				} else if c.compare != "" {
					ratio = " – |"
				}
				fmt.Fprintf(stdout, "| %s | %d KB | %d | %.3f ms | %.2f ms | %.3f ms | %.0f%% | %.0f | %.1f KB (%.2fx) | %.3f | %.0f (%.0f) | %.3f ms (%.3f ms) |%s\n",
					m, hist>>10, conc, median(added50), median(added99),
					med(px, func(r ovhRun) float64 { return r.routerCPU }),
					med(px, func(r ovhRun) float64 { return r.routerCPU * r.rate / 10 }),
					med(px, func(r ovhRun) float64 { return r.mallocs }),
					alloc/1024, alloc/body,
					med(px, func(r ovhRun) float64 { return r.hitRate }),
					med(px, func(r ovhRun) float64 { return r.rate }), med(dr, func(r ovhRun) float64 { return r.rate }),
					med(px, func(r ovhRun) float64 { return r.engineCPU }), med(dr, func(r ovhRun) float64 { return r.engineCPU }), ratio)
			}
		}
	}
	fmt.Fprintf(stdout, "\nmedians of %d interleaved repeats; added TTFT = proxy percentile - direct P-then-D percentile; CPU from /proc/PID/stat (utime+stime), allocations from the proxy's /metrics; router busy = router CPU time over the run's wall time (100%% = one core)\n", c.repeats)
	return nil
}

func goBuild(ctx context.Context, dir, out, pkg string) error {
	abs, err := filepath.Abs(out)
	if err != nil {
		return err
	}
	cmd := exec.CommandContext(ctx, "go", "build", "-o", abs, pkg)
	cmd.Dir = dir
	cmd.Stderr = os.Stderr
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("go build %s in %s: %w", pkg, dir, err)
	}
	return nil
}

// child is a started process and the URL it serves.
type child struct {
	cmd *exec.Cmd
	url string
}

var servingLine = regexp.MustCompile(`serving (http://\S+)`)

func startChild(ctx context.Context, path string, args ...string) (*child, error) {
	cmd := exec.CommandContext(ctx, path, args...)
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return nil, err
	}
	c := &child{cmd: cmd}
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		if m := servingLine.FindStringSubmatch(sc.Text()); m != nil {
			c.url = m[1]
			break
		}
	}
	if c.url == "" {
		c.stop()
		return nil, fmt.Errorf("%s %v: no ready line", path, args)
	}
	go func() { _, _ = io.Copy(io.Discard, out) }()
	return c, nil
}

func (c *child) stop() {
	if c.cmd.Process != nil {
		_ = c.cmd.Process.Signal(os.Interrupt)
		done := make(chan struct{})
		go func() { _ = c.cmd.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(5 * time.Second):
			_ = c.cmd.Process.Kill()
			<-done
		}
	}
}

// cpuSeconds returns the process's utime+stime from /proc/PID/stat.
func cpuSeconds(pid int) (float64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// Fields after the command name, which is in parentheses.
	i := bytes.LastIndexByte(b, ')')
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, errors.New("short /proc stat")
	}
	ut, _ := strconv.ParseFloat(f[11], 64)
	st, _ := strconv.ParseFloat(f[12], 64)
	return (ut + st) / clockTicks, nil
}

// clockTicks is USER_HZ, 100 on Linux.
const clockTicks = 100

func loadAvg() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

func cpuLine() string {
	n := 0
	model := ""
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if strings.HasPrefix(l, "processor") {
				n++
			}
			if v, ok := strings.CutPrefix(l, "model name"); ok && model == "" {
				model = strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(v), ":"))
			}
		}
	}
	return fmt.Sprintf("%d CPUs (%s)", n, model)
}

// memstats reads the proxy's allocation counters.
func memstats(ctx context.Context, client *http.Client, url string) (mallocs, bytes float64, err error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	if err != nil {
		return 0, 0, err
	}
	resp, err := client.Do(req)
	if err != nil {
		return 0, 0, err
	}
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		l := sc.Text()
		if v, ok := strings.CutPrefix(l, "go_memstats_mallocs_total "); ok {
			mallocs, _ = strconv.ParseFloat(v, 64)
		}
		if v, ok := strings.CutPrefix(l, "go_memstats_alloc_bytes_total "); ok {
			bytes, _ = strconv.ParseFloat(v, 64)
		}
	}
	return mallocs, bytes, sc.Err()
}

// ovhRun is one measured run.
type ovhRun struct {
	p50, p99             float64 // TTFT, ms
	rate                 float64 // turns/s
	routerCPU, engineCPU float64 // ms per turn
	mallocs, allocBytes  float64 // per turn
	bodyBytes            float64 // mean request body
	hitRate              float64
}

// measure runs turns closed-loop turns with conc clients, through proxy
// or (proxy nil) as a direct P-then-D chain.
func measure(ctx context.Context, client *http.Client, proxy, pe, de *child, hist, conc, turns int, salt string) (ovhRun, error) {
	var (
		next, hits, bodyBytes atomic.Int64
		mu                    sync.Mutex
		ttfts                 []float64
		firstErr              error
	)
	cpu := func() (router, engines float64) {
		p, _ := cpuSeconds(pe.cmd.Process.Pid)
		d, _ := cpuSeconds(de.cmd.Process.Pid)
		if proxy != nil {
			router, _ = cpuSeconds(proxy.cmd.Process.Pid)
		}
		return router, p + d
	}
	var m0, b0 float64
	if proxy != nil {
		var err error
		if m0, b0, err = memstats(ctx, client, proxy.url); err != nil {
			return ovhRun{}, err
		}
	}
	r0, e0 := cpu()
	start := time.Now()
	var wg sync.WaitGroup
	for w := range conc {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var conv *ovhConv
			for i := 0; ; i++ {
				n := next.Add(1)
				if n > int64(turns) || ctx.Err() != nil {
					return
				}
				if i%8 == 0 {
					conv = newOvhConv(fmt.Sprintf("%s-c%d-%d ", salt, w, i), hist)
				}
				body := conv.body(nil)
				bodyBytes.Add(int64(len(body)))
				var (
					ttft  time.Duration
					reply string
					hit   bool
					err   error
				)
				if proxy != nil {
					ttft, reply, hit, err = proxyTurn(ctx, client, proxy.url, body)
				} else {
					ttft, reply, err = directTurn(ctx, client, pe.url, de.url, conv)
				}
				mu.Lock()
				if err != nil && firstErr == nil {
					firstErr = err
				}
				ttfts = append(ttfts, float64(ttft.Microseconds())/1000)
				mu.Unlock()
				if err != nil {
					return
				}
				if hit {
					hits.Add(1)
				}
				conv.add(reply, fmt.Sprintf("Now run step %d.", i))
			}
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	if firstErr != nil {
		return ovhRun{}, firstErr
	}
	r1, e1 := cpu()
	r := ovhRun{
		p50:       percentile(ttfts, 50),
		p99:       percentile(ttfts, 99),
		rate:      float64(len(ttfts)) / elapsed.Seconds(),
		routerCPU: (r1 - r0) * 1000 / float64(len(ttfts)),
		engineCPU: (e1 - e0) * 1000 / float64(len(ttfts)),
		bodyBytes: float64(bodyBytes.Load()) / float64(len(ttfts)),
		hitRate:   float64(hits.Load()) / float64(len(ttfts)),
	}
	if proxy != nil {
		m1, b1, err := memstats(ctx, client, proxy.url)
		if err != nil {
			return ovhRun{}, err
		}
		r.mallocs = (m1 - m0) / float64(len(ttfts))
		r.allocBytes = (b1 - b0) / float64(len(ttfts))
	}
	return r, nil
}

// ovhConv is one benchmark conversation: a system message, a user message
// of about hist bytes of tool output, and the turns since.
type ovhConv struct {
	msgs []map[string]string
}

func newOvhConv(salt string, hist int) *ovhConv {
	var b strings.Builder
	b.WriteString(salt)
	words := []string{" func", " return", " err", " nil", " struct", " handle", " decode", " prefill", " stream", " token"}
	for i := 0; b.Len() < hist; i++ {
		if i%16 == 15 {
			b.WriteString("\n")
		}
		b.WriteString(words[i%len(words)])
	}
	return &ovhConv{msgs: []map[string]string{
		{"role": "system", "content": "You are a coding agent."},
		{"role": "user", "content": b.String()},
	}}
}

func (c *ovhConv) add(reply, next string) {
	c.msgs = append(c.msgs, map[string]string{"role": "assistant", "content": reply}, map[string]string{"role": "user", "content": next})
}

// body is the turn's streaming request, with extra members (the direct
// chain's legs) set.
func (c *ovhConv) body(extra map[string]any) []byte {
	m := map[string]any{"model": "sim-model", "messages": c.msgs, "max_tokens": 8, "stream": true}
	for k, v := range extra {
		m[k] = v
	}
	b, _ := json.Marshal(m)
	return b
}

// proxyTurn sends one turn through the proxy.
func proxyTurn(ctx context.Context, client *http.Client, url string, body []byte) (time.Duration, string, bool, error) {
	start := time.Now()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return 0, "", false, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return 0, "", false, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return 0, "", false, fmt.Errorf("proxy: %s: %s", resp.Status, b)
	}
	ttft, reply, err := readStream(resp.Body, start)
	return ttft, reply, resp.Header.Get("X-Bidikv-Reuse") == "hit", err
}

// directTurn is the zero-overhead baseline: the client sends the prefill
// leg to P and then the decode leg with P's handle to D itself.
func directTurn(ctx context.Context, client *http.Client, pURL, dURL string, conv *ovhConv) (time.Duration, string, error) {
	start := time.Now()
	pBody := conv.body(map[string]any{"stream": false, "max_tokens": 1,
		"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false}})
	resp, err := post(ctx, client, pURL, pBody)
	if err != nil {
		return 0, "", err
	}
	var pAns struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	err = json.NewDecoder(resp.Body).Decode(&pAns)
	resp.Body.Close()
	if err != nil || len(pAns.KV) == 0 {
		return 0, "", fmt.Errorf("prefill answer without a handle (%v)", err)
	}
	resp, err = post(ctx, client, dURL, conv.body(map[string]any{"kv_transfer_params": pAns.KV}))
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	return readStream(resp.Body, start)
}

func post(ctx context.Context, client *http.Client, url string, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return nil, err
	}
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		resp.Body.Close()
		return nil, fmt.Errorf("%s: %s: %s", url, resp.Status, b)
	}
	return resp, nil
}

// readStream reads a chat stream to its end and returns the time from
// start to the first event with content, and the reply.
func readStream(r io.Reader, start time.Time) (time.Duration, string, error) {
	var (
		ttft  time.Duration
		reply strings.Builder
	)
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 16<<20)
	for sc.Scan() {
		data, ok := bytes.CutPrefix(sc.Bytes(), []byte("data: "))
		if !ok || string(data) == "[DONE]" {
			continue
		}
		var ev struct {
			Choices []struct {
				Delta struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
		}
		if !bytes.Contains(data, []byte(`"content":"`)) {
			continue // no text: skip decoding (the first chunk may be large)
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			return 0, "", err
		}
		if len(ev.Choices) > 0 && ev.Choices[0].Delta.Content != "" {
			if ttft == 0 {
				ttft = time.Since(start)
			}
			reply.WriteString(ev.Choices[0].Delta.Content)
		}
	}
	if err := sc.Err(); err != nil {
		return 0, "", err
	}
	if ttft == 0 {
		return 0, "", errors.New("stream without content")
	}
	return ttft, reply.String(), nil
}

func median(vs []float64) float64 { return percentile(vs, 50) }

func med(runs []ovhRun, f func(ovhRun) float64) float64 {
	vs := make([]float64, len(runs))
	for i, r := range runs {
		vs[i] = f(r)
	}
	slices.Sort(vs)
	if len(vs) == 0 {
		return 0
	}
	return vs[len(vs)/2]
}
