package main

// Attack mode: bench --attack runs denial-of-service attacks against the
// proxy (GUARANTEES.md, "What the proxy bounds"), each against a fresh
// proxy process with simulated engines (vllmsim, qwen3-32b timings, in
// real time), and measures whether a well-behaved client keeps being
// served while the attack runs:
//
//	go run ./examples/bench --attack      (from the repository root)
//
// For each attack it runs the good client alone for --baseline, then sets
// up the attack (from 127.0.0.2; the good client connects from 127.0.0.1),
// then runs the good client again for --during, and reports
// the good client's turns served, shed (503) and failed, and their
// latency, with what the attack itself measures:
//
//   - slow-bodies: 256 connections send a completion request's headers
//     and 10 bytes of a 100 KB body, then one byte a second;
//   - declared: 8 connections declare the largest body (--max-body-bytes,
//     32 MiB) and send one byte;
//   - connections: --idle-conns (10,000) connections send GET /health and
//     stay open, idle; the good client opens a new connection for every
//     turn. It also reports the proxy's RSS per idle connection, measured
//     over the first 2,000 (below --max-connections);
//   - readers: --readers (64) clients ask for endless streams (100 tokens a
//     second) and read nothing; the proxy runs with --max-concurrent-turns
//     set to their number, so
//     they take every turn slot, and --client-write-timeout 5s; it reports
//     how long until half their turns are freed (at most --readers-wait);
//   - members: not a load but one request each of 18 MB bodies with many
//     members (3.6 million duplicate keys, and 600,000 messages), each
//     against a fresh proxy over canned engines (vllmsim --canned, which
//     answer at once); it reports the status and the proxy's peak RSS
//     (VmHWM), and its RSS idle before the request.
//
// --bin takes a directory with vllmsim and proxy binaries already built, to
// compare proxies of two commits; --nofile lowers the proxy's
// file-descriptor limit (with prlimit), so that the connections attack can
// exhaust it with fewer connections than this process may open.

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/bidikv/bidikv/internal/durflag"
	"github.com/bidikv/bidikv/kvroute/capability"
)

type attackConfig struct {
	repo, bin        string
	attacks          []string
	baseline, during time.Duration
	idleConns        int
	readersWait      time.Duration
	nofile           int
	// readers is the number of non-reading clients, and the proxy's
	// --max-concurrent-turns in that attack: they take every turn slot.
	readers int
}

var allAttacks = []string{"slow-bodies", "declared", "connections", "readers", "members"}

func parseAttackFlags(args []string, help io.Writer) (attackConfig, error) {
	c := attackConfig{}
	fs := newFlagSet("bench --attack")
	fs.Bool("attack", true, "attack mode (this mode)")
	fs.StringVar(&c.repo, "repo", ".", "repository root (to build examples/vllmsim and examples/proxy)")
	fs.StringVar(&c.bin, "bin", "", "directory with vllmsim and proxy binaries already built (default: build them into a temporary directory)")
	attacks := fs.String("attacks", strings.Join(allAttacks, ","), "attacks to run: "+strings.Join(allAttacks, ", "))
	fs.DurationVar(&c.baseline, "baseline", 3*time.Second, "how long the good client runs alone before each attack")
	fs.DurationVar(&c.during, "during", 5*time.Second, "how long the good client runs during each attack")
	fs.IntVar(&c.idleConns, "idle-conns", 10000, "idle connections of the connections attack")
	fs.IntVar(&c.readers, "readers", 64, "non-reading clients of the readers attack (the proxy's --max-concurrent-turns there)")
	fs.IntVar(&c.nofile, "nofile", 0, "the proxy's file-descriptor limit (prlimit --nofile), to see what exhausting it does (0: this process's)")
	fs.DurationVar(&c.readersWait, "readers-wait", 3*time.Minute, "how long the readers attack waits for the non-reading streams to be freed")
	if err := fs.Parse(args); err != nil {
		return c, flagError(fs, err, help)
	}
	if err := durflag.Check(fs, args, "baseline", "during", "readers-wait"); err != nil {
		return c, err
	}
	for _, a := range strings.Split(*attacks, ",") {
		if a = strings.TrimSpace(a); !slices.Contains(allAttacks, a) {
			return c, fmt.Errorf("--attacks: unknown attack %q; use %s", a, strings.Join(allAttacks, ", "))
		}
		c.attacks = append(c.attacks, a)
	}
	if c.idleConns < 1 || c.readers < 1 || c.nofile < 0 {
		return c, errors.New("--idle-conns and --readers must be positive, --nofile not negative")
	}
	return c, nil
}

// runAttack is bench --attack.
func runAttack(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	c, err := parseAttackFlags(args, stdout)
	if err != nil {
		return err
	}
	stderr = progressOut(stderr) // its lines are progress: on a terminal only
	bin := c.bin
	if bin == "" {
		dir, err := os.MkdirTemp("", "bidikv-attack-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		fmt.Fprintln(stderr, "attack: building vllmsim and proxy")
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
	engine := func(kv string) (*child, error) {
		p, err := startChild(ctx, filepath.Join(bin, "vllmsim"), "--port", "0", "--side-channel-port", "0",
			"--kv-transfer-config", kv, "--stream-handles", "--profile", "qwen3-32b", "--speed", "1",
			"--num-gpu-blocks-override", "2000000")
		if err == nil {
			procs = append(procs, p)
		}
		return p, err
	}
	pe, err := engine(capability.KVTransferPrefill)
	if err != nil {
		return err
	}
	de, err := engine(capability.KVTransferDecode)
	if err != nil {
		return err
	}
	// proxy starts a fresh proxy; stop ends it.
	proxy := func(extra ...string) (*child, error) {
		path, args := filepath.Join(bin, "proxy"), append([]string{"--port", "0",
			"--prefill", pe.url, "--decode", de.url, "--log-level", "error", "--health-interval", "1m"}, extra...)
		if c.nofile > 0 {
			// prlimit execs the proxy: the PID stays the proxy's.
			lim := strconv.Itoa(c.nofile)
			path, args = "prlimit", append([]string{"--nofile=" + lim + ":" + lim, path}, args...)
		}
		return startChild(ctx, path, args...)
	}
	fmt.Fprintf(stdout, "attack: %s, load average %s; good client: one closed-loop client, streamed chat turns of 8 tokens\n\n", cpuLine(), loadAvg())
	fmt.Fprintln(stdout, "| attack | good client alone: served, p50 / p99 | during the attack: served, shed (503), failed, p50 / p99 | measured |")
	fmt.Fprintln(stdout, "|---|---|---|---|")
	for _, a := range c.attacks {
		var (
			row string
			err error
		)
		if a == "members" {
			row, err = attackMembers(ctx, bin)
		} else {
			row, err = attackLoad(ctx, c, a, proxy)
		}
		if err != nil {
			return fmt.Errorf("%s: %w", a, err)
		}
		fmt.Fprintln(stdout, row)
	}
	return nil
}

// goodRun is what the good client got.
type goodRun struct {
	ok, shed, failed int
	lat              []float64 // ms, served turns
}

func (g goodRun) String() string {
	return fmt.Sprintf("%d, %.0f / %.0f ms", g.ok, percentile(g.lat, 50), percentile(g.lat, 99))
}

// goodClient runs closed-loop streamed chat turns for d, each on a new
// connection when fresh.
func goodClient(ctx context.Context, url string, d time.Duration, fresh bool) goodRun {
	tr := &http.Transport{DisableKeepAlives: fresh, DisableCompression: true}
	defer tr.CloseIdleConnections()
	client := &http.Client{Transport: tr, Timeout: 30 * time.Second}
	var g goodRun
	end := time.Now().Add(d)
	for i := 0; time.Now().Before(end) && ctx.Err() == nil; i++ {
		body := fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":"good client turn %d"}],"max_tokens":8,"stream":true}`, i)
		start := time.Now()
		_, _, _, err := proxyTurn(ctx, client, url, []byte(body))
		switch {
		case err == nil:
			g.ok++
			g.lat = append(g.lat, float64(time.Since(start))/float64(time.Millisecond))
		case strings.Contains(err.Error(), "503"):
			g.shed++
			time.Sleep(100 * time.Millisecond) // Retry-After is 1 s; a client retrying sooner only measures more often
		default:
			g.failed++
			time.Sleep(100 * time.Millisecond)
		}
	}
	return g
}

// attackLoad runs one load attack against a fresh proxy.
func attackLoad(ctx context.Context, c attackConfig, name string, proxy func(...string) (*child, error)) (string, error) {
	var extra []string
	if name == "readers" {
		extra = []string{"--client-write-timeout", "5s", "--max-concurrent-turns", strconv.Itoa(c.readers)}
	}
	p, err := proxy(extra...)
	if err != nil {
		return "", err
	}
	defer p.stop()
	fresh := name == "connections"
	base := goodClient(ctx, p.url, c.baseline, fresh)
	addr := strings.TrimPrefix(p.url, "http://")

	var (
		conns        []net.Conn
		measured     string
		stopBg       = make(chan struct{})
		bg           sync.WaitGroup
		readersStart time.Time
		freedAfter   atomic.Int64 // readers: when their turns were freed
	)
	defer func() {
		close(stopBg)
		for _, cn := range conns {
			_ = cn.Close()
		}
		bg.Wait()
	}()
	dial := func(rcvbuf int) (net.Conn, error) {
		// The attackers come from another loopback address than the
		// good client (127.0.0.0/8 is all loopback on Linux): bounds per
		// client address apply to them, not to it.
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, 2)}}
		if rcvbuf > 0 {
			d.Control = func(_, _ string, rc syscall.RawConn) error {
				return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, rcvbuf) })
			}
		}
		cn, err := d.DialContext(ctx, "tcp", addr)
		if err == nil {
			conns = append(conns, cn)
		}
		return cn, err
	}
	switch name {
	case "slow-bodies":
		for range 256 {
			cn, err := dial(0)
			if err != nil {
				return "", err
			}
			fmt.Fprintf(cn, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n{\"model\": ")
		}
		bg.Add(1)
		go func() { // one more byte a second on each
			defer bg.Done()
			t := time.NewTicker(time.Second)
			defer t.Stop()
			for {
				select {
				case <-stopBg:
					return
				case <-t.C:
					for _, cn := range conns {
						_ = cn.SetWriteDeadline(time.Now().Add(100 * time.Millisecond))
						_, _ = cn.Write([]byte(" "))
					}
				}
			}
		}()
		measured = "256 bodies trickling"
	case "declared":
		for range 8 {
			cn, err := dial(0)
			if err != nil {
				return "", err
			}
			fmt.Fprintf(cn, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n{", 32<<20)
		}
		measured = "8 x 32 MiB declared, 1 byte sent"
	case "connections":
		rss0, _ := rssKB(p.cmd.Process.Pid)
		const probe = 2000
		opened := 0
		dialErr, unanswered := "", 0
		for i := range c.idleConns {
			cn, err := dial(0)
			if err != nil {
				dialErr = fmt.Sprintf("; dialing stopped after %d: %v", i, err)
				break
			}
			_ = cn.SetDeadline(time.Now().Add(time.Second))
			fmt.Fprintf(cn, "GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
			if resp, err := http.ReadResponse(bufio.NewReader(cn), nil); err == nil {
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				opened++
				unanswered = 0
			} else if unanswered++; unanswered == 20 {
				dialErr = fmt.Sprintf("; the proxy stopped answering after %d connections", i+1-20)
				break
			}
			_ = cn.SetDeadline(time.Time{})
			if i+1 == probe {
				time.Sleep(500 * time.Millisecond)
				rss1, _ := rssKB(p.cmd.Process.Pid)
				measured = fmt.Sprintf("RSS %.1f KiB per idle connection (first %d); ", float64(rss1-rss0)/probe, probe)
			}
		}
		page, _ := metricsPage(ctx, p.url)
		measured += fmt.Sprintf("%d opened with an answer, proxy holds %s (%s idle), %s closed for new ones, %s refused",
			opened, page["bidikv_client_connections"], page["bidikv_idle_client_connections"],
			page["bidikv_evicted_connections_total"], page["bidikv_refused_connections_total"]) + dialErr
	case "readers":
		body := `{"model":"sim-model","messages":[{"role":"user","content":"tell me everything"}],"max_tokens":100000,"ignore_eos":true,"stream":true}`
		for range c.readers {
			cn, err := dial(0)
			if err != nil {
				return "", err
			}
			fmt.Fprintf(cn, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
		}
		readersStart = time.Now()
		bg.Add(1)
		go func() { // when the proxy frees the readers' turns
			defer bg.Done()
			held := false
			for {
				select {
				case <-stopBg:
					return
				case <-time.After(250 * time.Millisecond):
				}
				page, _ := metricsPage(ctx, p.url)
				n, _ := strconv.ParseFloat(page["bidikv_inflight_turns"], 64)
				held = held || int(n) >= c.readers
				if held && int(n) <= c.readers/2 {
					freedAfter.Store(int64(time.Since(readersStart)))
					return
				}
			}
		}()
	}
	time.Sleep(time.Second) // the attack lands before the good client runs again
	if name == "slow-bodies" || name == "declared" {
		page, _ := metricsPage(ctx, p.url)
		measured += fmt.Sprintf("; bodies in transit %s, buffered bytes %s, inflight turns %s, shed per client address %s",
			page["bidikv_request_bodies_in_transit"], page["bidikv_buffered_request_bytes"], page["bidikv_inflight_turns"],
			page[`bidikv_rejected_requests_total{reason="overloaded_client_bodies",status="503"}`])
	}
	during := goodClient(ctx, p.url, c.during, fresh)
	if name == "readers" {
		// Give the readers up to --readers-wait to be freed.
		for deadline := readersStart.Add(c.readersWait); freedAfter.Load() == 0 && time.Now().Before(deadline); {
			time.Sleep(250 * time.Millisecond)
		}
		if d := time.Duration(freedAfter.Load()); d > 0 {
			measured = fmt.Sprintf("%d non-reading streams (every turn slot) freed %.0f s after they started", c.readers, d.Seconds())
		} else {
			measured = fmt.Sprintf("%d non-reading streams (every turn slot) still held %.0f s after they started", c.readers, time.Since(readersStart).Seconds())
		}
	}
	return fmt.Sprintf("| %s | %s | %d, %d, %d, %.0f / %.0f ms | %s |", name, base, during.ok, during.shed, during.failed,
		percentile(during.lat, 50), percentile(during.lat, 99), measured), nil
}

// attackMembers sends each many-member body to a fresh proxy over canned
// engines (which answer at once: the proxy's memory is measured, not the
// engines' time) and reports its status and the proxy's peak RSS.
func attackMembers(ctx context.Context, bin string) (string, error) {
	var engines []*child
	defer func() {
		for _, e := range engines {
			e.stop()
		}
	}()
	for _, role := range []string{"prefill", "decode"} {
		e, err := startChild(ctx, filepath.Join(bin, "vllmsim"), "--canned", role, "--port", "0")
		if err != nil {
			return "", err
		}
		engines = append(engines, e)
	}
	proxy := func() (*child, error) {
		return startChild(ctx, filepath.Join(bin, "proxy"), "--port", "0", "--prefill", engines[0].url, "--decode", engines[1].url,
			"--log-level", "error", "--health-interval", "1m")
	}
	const size = 18 << 20
	bodies := []struct{ name, body string }{
		{"3.6M duplicate members", manyMembers(size, `,"a":0`, `{"model":"sim-model","max_tokens":8,"messages":[{"role":"user","content":"hi"}]`, "}")},
		{"600k messages", manyMembers(size, `,{"role":"user","content":"x"}`, `{"model":"sim-model","max_tokens":8,"messages":[{"role":"user","content":"hi"}`, "]}")},
	}
	var parts []string
	for _, b := range bodies {
		p, err := proxy()
		if err != nil {
			return "", err
		}
		time.Sleep(200 * time.Millisecond)
		idle, _ := hwmKB(p.cmd.Process.Pid)
		client := &http.Client{Timeout: 60 * time.Second}
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+"/v1/chat/completions", strings.NewReader(b.body))
		if err != nil {
			p.stop()
			return "", err
		}
		req.Header.Set("Content-Type", "application/json")
		status := "error"
		if resp, err := client.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			status = strconv.Itoa(resp.StatusCode)
		}
		peak, _ := hwmKB(p.cmd.Process.Pid)
		p.stop()
		parts = append(parts, fmt.Sprintf("%s (%d MB): %s, peak RSS %d MB (idle %d MB, %.1fx the body above idle)",
			b.name, len(b.body)/1e6, status, peak/1024, idle/1024, float64(peak-idle)*1024/float64(len(b.body))))
	}
	return "| members | — | — | " + strings.Join(parts, "; ") + " |", nil
}

func manyMembers(size int, member, head, tail string) string {
	var b strings.Builder
	b.Grow(size + len(member) + len(tail))
	b.WriteString(head)
	for b.Len() < size {
		b.WriteString(member)
	}
	b.WriteString(tail)
	return b.String()
}

// rssKB and hwmKB read a process's resident set size and its peak.
func rssKB(pid int) (int64, error) { return procStatus(pid, "VmRSS:") }
func hwmKB(pid int) (int64, error) { return procStatus(pid, "VmHWM:") }

func procStatus(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, field); ok {
			f := strings.Fields(v)
			if len(f) > 0 {
				return strconv.ParseInt(f[0], 10, 64)
			}
		}
	}
	return 0, fmt.Errorf("no %s in /proc/%d/status", field, pid)
}

// metricsPage reads the proxy's /metrics samples without labels, and the
// few with labels this mode reads, by their full name.
func metricsPage(ctx context.Context, url string) (map[string]string, error) {
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	tr := &http.Transport{DisableKeepAlives: true}
	defer tr.CloseIdleConnections()
	resp, err := (&http.Client{Transport: tr}).Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	out := map[string]string{}
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		if k, v, ok := strings.Cut(sc.Text(), " "); ok && !strings.HasPrefix(k, "#") {
			out[k] = v
		}
	}
	for _, k := range []string{"bidikv_client_connections", "bidikv_idle_client_connections", "bidikv_evicted_connections_total",
		"bidikv_refused_connections_total", "bidikv_request_bodies_in_transit", `bidikv_rejected_requests_total{reason="overloaded_client_bodies",status="503"}`} {
		if _, ok := out[k]; !ok {
			out[k] = "n/a"
		}
	}
	return out, sc.Err()
}
