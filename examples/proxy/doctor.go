package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/transport"
)

// errNoReuse is the doctor's verdict that reuse cannot work with these
// engines and flags (exit status 1; the report says why).
var errNoReuse = errors.New("doctor: reuse cannot work with these engines and flags")

// doctorOptions are the doctor's own flags.
type doctorOptions struct {
	probe     bool
	json      bool
	strict    bool
	timeout   time.Duration // one engine's capability probe
	probeTime time.Duration // all the --probe conversations
	maxTokens int
	tier      tierOptions
}

// doctorUsage is the doctor's synopsis, above its flags in --help.
const doctorUsage = `Usage: bidikv-proxy doctor [engine flags] [--probe] [--json] [--strict]

Asks every engine the proxy would use what it offers (GET /version, /v1/models,
/metrics, the render routes, /tokenize), and prints, per engine and per API,
what works, what does not, and the exact fix for each gap. It takes the proxy's
own flags, so it checks the configuration you run against the engines you have.
With --probe it also runs a short conversation per API (temperature 0, a few
tokens) through an in-process router, streaming and not, checks that later
turns reuse KV and that each reused answer equals the same turn sent with reuse
off, and reports TTFT with reuse off and on. Exit status: 0 reuse works, 1 it
cannot (or a reused answer differed), 2 a bad command line; with --strict, 1 on
any gap. With --cpu-tier it also checks the decode engines' CPU tier for peer
pulls by the prefill engines (with --probe: one pull per decode engine).
The proxy's flags below are the ones it checks (and --probe uses).
`

// flags adds the doctor's own flags to fs.
func (o *doctorOptions) flags(fs *flag.FlagSet) {
	fs.BoolVar(&o.probe, "probe", false, "also run a short conversation per API and mode through an in-process router: later turns must reuse KV and equal the same turn with reuse off (temperature 0)")
	fs.BoolVar(&o.json, "json", false, "print the report as JSON")
	fs.BoolVar(&o.strict, "strict", false, "exit 1 on any gap, not only when reuse cannot work at all")
	fs.DurationVar(&o.timeout, "probe-engine-timeout", capability.DefaultTimeout, "bound on the capability probe of one engine")
	fs.DurationVar(&o.probeTime, "probe-timeout", 2*time.Minute, "bound on all the --probe conversations (and on the --cpu-tier pulls)")
	fs.IntVar(&o.maxTokens, "probe-max-tokens", 12, "max_tokens of each --probe turn")
	o.tier.flags(fs)
}

// runDoctor is `bidikv-proxy doctor`.
func runDoctor(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	o := doctorOptions{}
	cfg, err := parseCommand("bidikv-proxy doctor", doctorUsage, args, getenv, stdout, o.flags)
	if err != nil {
		return err
	}
	o.tier.cpuTier = cfg.memory.tier
	log := newLogger(cfg, stderr)
	if len(cfg.dns.pools()) > 0 {
		dctx, cancel := context.WithTimeout(ctx, 30*time.Second)
		err := resolveDNS(dctx, cfg, nil, log)
		cancel()
		if err != nil {
			return err
		}
	}
	tr, err := transport.NewTransport()
	if err != nil {
		return err
	}
	defer tr.CloseIdleConnections()

	engines := cfg.probeEngines(ctx, tr, o.timeout)
	var runs []probeRun
	if o.probe {
		pctx, cancel := context.WithTimeout(ctx, o.probeTime)
		runs = cfg.probeConversations(pctx, tr, engines, o.maxTokens, log)
		cancel()
	}
	rep := cfg.diagnose(engines, runs)
	rep.noCompute = o.probe && simulatedNoCompute(ctx, tr, engines, o.timeout)
	if o.tier.on {
		checks := o.tier.tierChecks(engines)
		if o.probe {
			pctx, cancel := context.WithTimeout(ctx, o.probeTime)
			checks = append(checks, o.tier.tierProbe(pctx, tr, cfg, engines)...)
			cancel()
		} else {
			checks = append(checks, notExported)
		}
		rep.addTier(checks)
	}
	if o.json {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep.jsonForm()); err != nil {
			return err
		}
	} else {
		rep.write(stdout, cfg, o.tier.port)
	}
	switch {
	case !rep.works:
		return errNoReuse
	case o.strict && (len(rep.gaps) > 0 || !rep.allAPIs()):
		return errNoReuse
	}
	return nil
}

// probeEngines probes every configured engine at once.
func (c *config) probeEngines(ctx context.Context, rt http.RoundTripper, timeout time.Duration) []engineFacts {
	var engines []engineFacts
	for _, u := range c.prefillURLs {
		engines = append(engines, engineFacts{role: rolePrefill, url: strings.TrimRight(u, "/")})
	}
	for _, u := range c.decodeURLs {
		engines = append(engines, engineFacts{role: roleDecode, url: strings.TrimRight(u, "/")})
	}
	opts := []capability.Option{capability.WithTimeout(timeout)}
	if c.upstreamAPIKey != "" {
		opts = append(opts, capability.WithAPIKey(c.upstreamAPIKey))
	}
	var wg sync.WaitGroup
	for i := range engines {
		wg.Go(func() {
			ep, err := transport.ParseEndpoint(engines[i].url)
			if err != nil {
				engines[i].rep = &capability.Report{Endpoint: engines[i].url, Error: err.Error()}
				return
			}
			engines[i].rep = capability.Probe(ctx, rt, ep, opts...)
		})
	}
	wg.Wait()
	return engines
}

// diagnosis is the doctor's report.
type diagnosis struct {
	engines []engineFacts
	views   []apiView
	gaps    []gap
	runs    []probeRun
	// noCompute: every engine is a simulator modelling no compute (its
	// GET /sim/stats), so the probe's TTFTs hold none.
	noCompute bool
	tier      []tierCheck // --cpu-tier
	works     bool        // reuse can work on at least one API, and no reused answer differed
	verdict   string      // one line
}

// diagnose weighs the engines' facts (and the --probe runs) against the
// configuration.
func (c *config) diagnose(engines []engineFacts, runs []probeRun) *diagnosis {
	d := &diagnosis{engines: engines, views: c.views(engines), gaps: c.gaps(engines), runs: runs}
	var yes, no []string
	for _, v := range d.views {
		if v.reuse == capability.Absent {
			no = append(no, string(v.api))
		} else {
			yes = append(yes, string(v.api))
		}
	}
	d.works = len(yes) > 0 && !blocking(d.gaps)
	for _, e := range engines {
		if e.rep == nil || !e.rep.Reachable {
			d.works = false
		}
	}
	switch {
	case blocking(d.gaps):
		d.verdict = "reuse cannot work: " + firstError(d.gaps)
	case !d.works && len(yes) == 0:
		d.verdict = "reuse cannot work on any API"
	case !d.works:
		d.verdict = "reuse cannot work: an engine is unreachable"
	case len(no) == 0:
		d.verdict = "reuse can work on every API"
	default:
		d.verdict = "reuse can work on " + strings.Join(yes, ", ") + "; not on " + strings.Join(no, ", ")
	}
	if len(runs) > 0 {
		hits, differ := 0, 0
		for _, r := range runs {
			hits += r.hits
			differ += r.reused - r.equal
		}
		switch {
		case differ > 0:
			d.works = false
			d.verdict = fmt.Sprintf("%d reused answers differed from the same turns with reuse off: do not enable reuse with these engines", differ)
		case hits == 0:
			d.works = false
			d.verdict = "the probe reused KV on no turn: reuse does not work with these engines"
		default:
			d.verdict += fmt.Sprintf("; the probe reused KV on %d turns, every reused answer equal to the plain one", hits)
		}
	}
	return d
}

func firstError(gaps []gap) string {
	for _, g := range gaps {
		if g.severity == gapError {
			return g.what
		}
	}
	return ""
}

// allAPIs reports whether every API reuses, streaming and not.
func (d *diagnosis) allAPIs() bool {
	for _, v := range d.views {
		if v.reuse != capability.Present || v.streamed != capability.Present {
			return false
		}
	}
	return true
}

// mark writes a state for a table.
func mark(s capability.State) string {
	switch s {
	case capability.Present:
		return "ok"
	case capability.Absent:
		return "NO"
	}
	return "unknown"
}

// write prints the report as text: the engines (those with the same facts
// together), the APIs, the --probe conversations, the gaps with their
// fixes, and the verdict.
func (d *diagnosis) write(w io.Writer, c *config, tierPort int) {
	np, nd := 0, 0
	for _, e := range d.engines {
		if e.role == rolePrefill {
			np++
		} else {
			nd++
		}
	}
	bs := strconv.Itoa(c.blockSize)
	if c.blockSize == 0 {
		bs = "0 (each engine's own)"
	}
	fmt.Fprintf(w, "bidikv-proxy doctor: %s and %s; --verification %s, --block-size %s, --recompute-threshold %d\n",
		plural(np, "prefill engine"), plural(nd, "decode engine"), c.verification, bs, c.recomputeThresh)
	for _, g := range groupEngines(d.engines) {
		fmt.Fprintln(w)
		for _, e := range g {
			fmt.Fprintf(w, "%s %s\n", e.role, printable(e.url))
		}
		rep := g[0].rep
		if rep == nil || !rep.Reachable {
			reason := "not probed"
			if rep != nil {
				reason = rep.Summary()
			}
			fmt.Fprintf(w, "  %s\n", printable(reason))
			continue
		}
		head, _, _ := strings.Cut(rep.Summary(), "; works:")
		fmt.Fprintf(w, "  %s\n", printable(head))
		fmt.Fprintf(w, "  %s\n", printable(c.blockSizeLine(g[0])))
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, n := range capability.Fold(rep.Facts()) {
			fmt.Fprintf(tw, "  %s\t%s\t%s\n", n.Name, mark(n.Fact.State), printable(n.Fact.Why))
		}
		_ = tw.Flush()
	}

	fmt.Fprintf(w, "\nper API\n")
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintf(tw, "  API\tverification\thandles\tstream handles\treuse\tstreamed reuse\twhy not\n")
	for _, v := range d.views {
		verify := v.verification
		if v.verifyState != capability.Present {
			verify += " (" + mark(v.verifyState) + ")"
		}
		streams := mark(v.streams)
		if v.buffered && v.streams != capability.Present {
			streams += " (buffered)"
		}
		fmt.Fprintf(tw, "  %s\t%s\t%s\t%s\t%s\t%s\t%s\n", v.api, verify, mark(v.handles), streams, mark(v.reuse), mark(v.streamed), printable(v.why))
	}
	_ = tw.Flush()

	if len(d.runs) > 0 {
		fmt.Fprintf(w, "\nprobe: %d-turn conversations (temperature 0), each turn also sent with reuse off\n", probeTurns)
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintf(tw, "  API\tmode\tturns\treused\tequal\tTTFT off p50\tTTFT on p50\tnote\n")
		for _, r := range d.runs {
			mode := "body"
			if r.stream {
				mode = "stream"
			}
			fmt.Fprintf(tw, "  %s\t%s\t%d\t%d\t%d/%d\t%s\t%s\t%s\n", r.api, mode, r.turns, r.hits, r.equal, r.reused,
				ms(r.ttftOff), ms(r.ttftOn), printable(r.note))
		}
		_ = tw.Flush()
		writeNotes(w, d.runs, d.noCompute)
	}

	d.writeTier(w, tierPort)
	if len(d.gaps) > 0 {
		fmt.Fprintf(w, "\ngaps and fixes\n")
		for _, g := range d.gaps {
			fmt.Fprintf(w, "  %s: %s\n", g.severity, printable(g.what))
			if g.fix != "" {
				fmt.Fprintf(w, "    fix: %s\n", printable(g.fix))
			}
		}
	}
	fmt.Fprintf(w, "\n%s\n", printable(d.verdict))
}

// blockSizeLine says at which block size the router checks and cuts e's
// handles, where it comes from, and whether e serves without reuse.
func (c *config) blockSizeLine(e engineFacts) string {
	var s string
	switch b := e.rep.BlockSize; {
	case b > 0 && c.blockSize > 0 && b != c.blockSize:
		s = fmt.Sprintf("block size %d, the engine's (--block-size %d yields to it)", b, c.blockSize)
	case b > 0:
		s = fmt.Sprintf("block size %d, the engine's: its handles are checked and cut at it", b)
	case c.blockSize > 0:
		s = fmt.Sprintf("block size %d, from --block-size (the engine reports none)", c.blockSize)
	default:
		s = "block size unknown (the engine reports none, --block-size 0): its handles are reused whole only, their block counts unchecked"
	}
	if st := e.status; st != nil {
		if st.KVGroups > 1 {
			s += fmt.Sprintf("; %d KV groups in its handles", st.KVGroups)
		}
		if st.NoReuse != "" {
			s += "; serves without reuse: " + st.NoReuse
		}
	}
	return s
}

// printable is a string the doctor prints that may hold an engine's words
// (its version, model, error messages, URLs): every control or format
// character (a terminal escape, a carriage return, a line break, a
// bidirectional override) and every invalid byte written as Go escapes it
// (\x1b, \r, \n, \u202e), so that an engine cannot rewrite the terminal or
// forge report lines. Every such string goes through it.
func printable(s string) string {
	clean := true
	for _, r := range s {
		if r == utf8.RuneError || unicode.IsControl(r) || unicode.Is(unicode.Cf, r) {
			clean = false
			break
		}
	}
	if clean {
		return s
	}
	var b strings.Builder
	for i, w := 0, 0; i < len(s); i += w {
		r, n := utf8.DecodeRuneInString(s[i:])
		w = n
		switch {
		case r == utf8.RuneError && n == 1:
			fmt.Fprintf(&b, `\x%02x`, s[i])
		case unicode.IsControl(r) || unicode.Is(unicode.Cf, r) || r == utf8.RuneError:
			q := strconv.QuoteRuneToASCII(r)
			b.WriteString(q[1 : len(q)-1])
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// plural writes "1 prefill engine", "2 prefill engines".
func plural(n int, what string) string {
	if n == 1 {
		return "1 " + what
	}
	return fmt.Sprintf("%d %ss", n, what)
}

// groupEngines groups the engines whose capabilities read the same, in
// order of first appearance.
func groupEngines(engines []engineFacts) [][]engineFacts {
	key := func(e engineFacts) string {
		if e.rep == nil || !e.rep.Reachable {
			return "\x00" + e.url // never grouped
		}
		var b strings.Builder
		b.WriteString(e.rep.VLLMVersion + "|" + e.rep.Model + "|" + fmt.Sprint(e.rep.BlockSize, e.rep.NumGPUBlocks, e.rep.KVCacheTokens, e.rep.DataParallel))
		if e.status != nil {
			b.WriteString(fmt.Sprint("|", e.status.KVGroups, e.status.NoReuse))
		}
		for _, n := range e.rep.Facts() {
			b.WriteString("|" + n.Name + "=" + string(n.Fact.State) + ":" + n.Fact.Why)
		}
		return b.String()
	}
	var groups [][]engineFacts
	index := map[string]int{}
	for _, e := range engines {
		k := key(e)
		if i, ok := index[k]; ok {
			groups[i] = append(groups[i], e)
			continue
		}
		index[k] = len(groups)
		groups = append(groups, []engineFacts{e})
	}
	return groups
}

// ms writes a duration in milliseconds, "-" for none.
func ms(d time.Duration) string {
	if d <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.1fms", float64(d)/float64(time.Millisecond))
}

// jsonForm is the report for --json.
func (d *diagnosis) jsonForm() any {
	type engineJSON struct {
		Role         string             `json:"role"`
		Endpoint     string             `json:"endpoint"`
		Capabilities *capability.Report `json:"capabilities"`
		// What the --probe router's turns showed: the block size its
		// handles were checked at and where it came from, its KV groups,
		// why it serves without reuse.
		BlockSize       int    `json:"block_size,omitempty"`
		BlockSizeSource string `json:"block_size_source,omitempty"`
		KVGroups        int    `json:"kv_groups,omitempty"`
		NoReuse         string `json:"no_reuse,omitempty"`
	}
	type apiJSON struct {
		API           string `json:"api"`
		Verification  string `json:"verification"`
		Handles       string `json:"handles"`
		StreamHandles string `json:"stream_handles"`
		Reuse         string `json:"reuse"`
		StreamedReuse string `json:"streamed_reuse"`
		Why           string `json:"why,omitempty"`
		Fix           string `json:"fix,omitempty"`
		VerifyState   string `json:"verification_state"`
	}
	type gapJSON struct {
		Severity string `json:"severity"`
		What     string `json:"what"`
		Fix      string `json:"fix,omitempty"`
	}
	type runJSON struct {
		API       string  `json:"api"`
		Stream    bool    `json:"stream"`
		Turns     int     `json:"turns"`
		Reused    int     `json:"reused"`
		Equal     int     `json:"equal"`
		TTFTOffMS float64 `json:"ttft_off_p50_ms"`
		TTFTOnMS  float64 `json:"ttft_on_p50_ms"`
		Note      string  `json:"note,omitempty"`
		Meaning   string  `json:"note_meaning,omitempty"`
	}
	out := struct {
		Engines []engineJSON `json:"engines"`
		APIs    []apiJSON    `json:"apis"`
		Gaps    []gapJSON    `json:"gaps"`
		Probe   []runJSON    `json:"probe,omitempty"`
		CPUTier []tierJSON   `json:"cpu_tier,omitempty"`
		// NoCompute: every engine is a simulator that models no compute
		// (GET /sim/stats: ModelsCompute false).
		NoCompute bool   `json:"ttft_models_no_compute,omitempty"`
		Works     bool   `json:"reuse_works"`
		Verdict   string `json:"verdict"`
	}{Works: d.works, Verdict: d.verdict, Gaps: []gapJSON{}, NoCompute: d.noCompute, CPUTier: d.tierJSON()}
	for _, e := range d.engines {
		ej := engineJSON{Role: e.role, Endpoint: e.url, Capabilities: e.rep}
		if st := e.status; st != nil {
			ej.BlockSize, ej.BlockSizeSource, ej.KVGroups, ej.NoReuse = st.BlockSize, st.BlockSizeSource, st.KVGroups, st.NoReuse
		}
		out.Engines = append(out.Engines, ej)
	}
	for _, v := range d.views {
		out.APIs = append(out.APIs, apiJSON{string(v.api), v.verification, string(v.handles), string(v.streams),
			string(v.reuse), string(v.streamed), v.why, v.fix, string(v.verifyState)})
	}
	for _, g := range d.gaps {
		out.Gaps = append(out.Gaps, gapJSON{g.severity, g.what, g.fix})
	}
	for _, r := range d.runs {
		out.Probe = append(out.Probe, runJSON{string(r.api), r.stream, r.turns, r.hits, r.equal,
			float64(r.ttftOff) / float64(time.Millisecond), float64(r.ttftOn) / float64(time.Millisecond), r.note, noteMeaning(r.reason)})
	}
	return out
}
