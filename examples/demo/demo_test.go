package main

import (
	"bytes"
	"context"
	"encoding/xml"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/threshold"
)

func TestMain(m *testing.M) {
	if os.Getenv("BIDIKV_DEMO_MAIN") != "" { // TestHelpExitsZero: this process is the demo
		os.Args = append([]string{"demo"}, strings.Fields(os.Getenv("BIDIKV_DEMO_MAIN"))...)
		main()
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// TestPublishedPoints runs the demo's conversations (one per profile) and
// checks, at the published prompt lengths, the modelled engine figures
// against the published ones within 10% (qwen3-32b's TTFT on at 2k within
// 35%: it is below its own prefill on, see internal/sim/cost.go), the
// off/on ratio at the longest prompt within 10%, and the demo's shape: a
// flat "on" curve, every later turn a hit, answers identical to a single
// engine's.
func TestPublishedPoints(t *testing.T) {
	if testing.Short() {
		t.Skip("runs two short demos")
	}
	for _, name := range []string{"qwen3-32b", "glm-5-fp8"} {
		t.Run(name, func(t *testing.T) {
			c, err := parseFlags([]string{"--profile", name, "--conversations", "1", "--quiet"}, io.Discard)
			require.NoError(t, err)
			require.Len(t, c.published, 2)
			require.Equal(t, c.published[1].tokens, c.endTokens)
			s, err := run(context.Background(), c, nil)
			require.NoError(t, err)

			for i, p := range c.published {
				m, ok := s.pointAt(p.tokens)
				require.True(t, ok, "no turn at %d tokens", p.tokens)
				within := func(what string, want float64, got time.Duration, tol float64) {
					ms := msf(got)
					t.Logf("%5d %-11s published %5.0f ms, modelled %7.1f ms (%+5.1f%%)", p.tokens, what, want, ms, 100*(ms/want-1))
					assert.InEpsilon(t, want, ms, tol, "%d tokens, %s", p.tokens, what)
				}
				onTol := 0.10
				if name == "qwen3-32b" && i == 0 {
					onTol = 0.35
					assert.Greater(t, m.on, m.prefillOn)
				}
				within("TTFT off", p.off, m.off, 0.10)
				within("TTFT on", p.on, m.on, onTol)
				within("prefill on", p.prefillOn, m.prefillOn, 0.10)
				within("KV transfer", p.transfer, m.transfer, 0.10)
			}
			last := c.published[len(c.published)-1]
			m, _ := s.pointAt(last.tokens)
			assert.InEpsilon(t, last.off/last.on, float64(m.off)/float64(m.on), 0.10, "the off/on ratio at the longest prompt")
			_, ok := s.ratioAt(c.endTokens)
			require.True(t, ok) // printed with the measured overhead, which a loaded machine skews

			first, _ := s.pointAt(c.startTokens)
			assert.Less(t, m.on-first.on, (m.off-first.off)*2/3,
				"the reuse-on curve should be far flatter than the reuse-off one")
			end := s.buckets[len(s.buckets)-1]
			assert.InDelta(t, float64(c.turns-1)/float64(c.turns), s.hitRate, 1e-9, "every turn after the first should hit")
			assert.Zero(t, s.wrong)
			assert.InDelta(t, 1-1/c.growth(), end.recomputed, 0.03, "with reuse P computes only what the turn added")
			assert.Positive(t, end.heldTokens)
			assert.Equal(t, c.turns-1, s.verification.calls, "token verification renders every hit")
		})
	}
}

// TestReasoning runs --reasoning: replies carry reasoning that the template
// drops from history. The router's default, token verification, reuses the
// prefix the template kept (a partial hit every turn); content verification
// reuses nothing.
func TestReasoning(t *testing.T) {
	if testing.Short() {
		t.Skip("runs two short demos")
	}
	run1 := func(extra ...string) summary {
		c, err := parseFlags(append([]string{"--reasoning", "--conversations", "1", "--quiet"}, extra...), io.Discard)
		require.NoError(t, err)
		require.True(t, c.reasoning)
		s, err := run(context.Background(), c, nil)
		require.NoError(t, err)
		assert.Zero(t, s.wrong)
		return s
	}
	// Modelled ratios (engines only): the printed ones add the measured
	// router overhead, which a loaded machine skews.
	ratio := func(s summary) float64 {
		m, ok := s.pointAt(24000)
		require.True(t, ok)
		return float64(m.off) / float64(m.on)
	}
	s := run1()
	assert.Greater(t, ratio(s), 1.5)
	assert.InDelta(t, 11.0/12, s.hitRate, 1e-9)
	assert.Equal(t, 11, s.verification.calls)
	assert.Equal(t, 11, s.verification.partial, "the reasoning is not in the next prompt: only the prefix before it is reused")
	assert.Positive(t, s.verification.unverified)
	assert.Positive(t, s.verification.longRender)
	assert.Empty(t, s.published, "the published points are not for reasoning conversations")
	var out bytes.Buffer
	s.print(&out)
	assert.Contains(t, out.String(), "render on the API server (MODELLED")
	assert.Contains(t, out.String(), "the router's side of the render call (MEASURED")
	assert.Contains(t, out.String(), "reuse on p50")

	content := run1("--verification", "content")
	assert.InDelta(t, 1, ratio(content), 1e-9)
	assert.Zero(t, content.hitRate)
}

func TestRunMainWritesTablesAndChart(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a short demo")
	}
	svg := filepath.Join(t.TempDir(), "chart.svg")
	var out, errOut bytes.Buffer
	err := runMain(context.Background(), []string{"--conversations", "1", "--turns", "3", "--max-tokens", "6000", "--svg", svg}, &out, &errOut)
	require.NoError(t, err)
	assert.Contains(t, out.String(), "MODELLED")
	assert.Contains(t, out.String(), "MEASURED")
	assert.Contains(t, out.String(), "off/on p50")
	assert.Empty(t, errOut.String(), "no progress frames on a stderr that is not a terminal")
	raw, err := os.ReadFile(svg)
	require.NoError(t, err)
	assertWellFormed(t, raw)
	assert.Contains(t, string(raw), "reuse on")
	// Every figure of the chart's footer is in the text output, as written
	// there.
	foot := regexp.MustCompile(`<text x="70" y="418" fill="#555">hit rate (\d+%); off/on TTFT p50 at the longest prompt \((\S+)\): (\S+×); router overhead p50 \(measured\): reuse off (\S+), on (\S+)</text>`).FindStringSubmatch(string(raw))
	require.NotNil(t, foot, "%s", raw)
	text := out.String()
	assert.Contains(t, text, "hit rate "+foot[1]+" ")
	assert.Contains(t, text, "off/on TTFT p50 at the longest prompt ("+foot[2]+"): "+foot[3])
	assert.Contains(t, text, "reuse off p50 "+foot[4]+" ")
	assert.Contains(t, text, "reuse on p50 "+foot[5]+" ")
}

// chartTicks returns the tick labels of the TTFT panel: x along the bottom
// (font size 10, y just under the axis) and y on the left.
func chartTicks(svg string) (x, y []string) {
	for _, m := range regexp.MustCompile(`<text x="[0-9.]+" y="374" text-anchor="middle" font-size="10">([^<]+)</text>`).FindAllStringSubmatch(svg, -1) {
		x = append(x, m[1])
	}
	for _, m := range regexp.MustCompile(`<text x="66" y="[0-9.]+" text-anchor="end" font-size="10">([^<]+)</text>`).FindAllStringSubmatch(svg, -1) {
		y = append(y, m[1])
	}
	return x, y
}

// TestChartAxes: the axes fit the data, x up to the longest prompt and y
// up to the largest value, with exact, evenly spaced tick labels; with
// prompts in a narrow band (--suffix-tokens) x starts just under the first,
// and bars are labelled distinctly; every point lies in its panel, and the
// legend covers none of them.
func TestChartAxes(t *testing.T) {
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	series := func(tokens []int, off, on []float64) summary {
		s := summary{profile: "qwen3-32b", hitRate: 0.92}
		for i, tok := range tokens {
			s.buckets = append(s.buckets, bucket{turn: i, tokens: tok, on: []turn{{}}, off: []turn{{}},
				offP: [3]time.Duration{ms(off[i]), ms(off[i] * 1.02), ms(off[i] * 1.05)},
				onP:  [3]time.Duration{ms(on[i]), ms(on[i] * 1.02), ms(on[i] * 1.05)}, offRecompute: ms(off[i] * 0.9), onRecompute: ms(on[i] * 0.5)})
		}
		return s
	}
	cases := []struct {
		name string
		s    summary
		x, y []string
		bars int
	}{
		{"published shape", series([]int{1600, 2000, 2600, 3300, 4200, 5400, 6900, 8900, 11000, 15000, 19000, 24000},
			[]float64{154, 155, 166, 180, 200, 224, 260, 312, 376, 464, 600, 793},
			[]float64{154, 160, 166, 174, 185, 197, 217, 245, 273, 314, 387, 478}),
			[]string{"0", "5k", "10k", "15k", "20k", "25k"}, []string{"0", "200", "400", "600", "800", "1000"}, 12},
		{"--suffix-tokens 300", series([]int{20500, 20800, 21200, 21500, 21800, 22100, 22400, 22700, 23100, 23400, 23700, 24000},
			[]float64{759, 649, 660, 671, 683, 694, 706, 717, 729, 741, 753, 765},
			[]float64{760, 61, 61, 62, 62, 62, 62, 62, 68, 64, 63, 64}),
			[]string{"20k", "21k", "22k", "23k", "24k"}, []string{"0", "200", "400", "600", "800"}, 12},
		{"small values", series([]int{100, 200, 300}, []float64{0.2, 0.4, 0.7}, []float64{0.1, 0.2, 0.3}),
			[]string{"0", "100", "200", "300"}, []string{"0", "0.2", "0.4", "0.6", "0.8"}, 3},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			var buf bytes.Buffer
			require.NoError(t, writeSVG(&buf, tc.s))
			svg := buf.String()
			assertWellFormed(t, buf.Bytes())
			x, y := chartTicks(svg)
			assert.Equal(t, tc.x, x[:len(tc.x)], "x ticks")
			assert.Equal(t, tc.y, y, "y ticks of the TTFT panel")
			bars := x[len(tc.x):]
			assert.Len(t, bars, tc.bars)
			seen := map[string]bool{}
			for _, b := range bars {
				assert.False(t, seen[b], "bar label %s twice: %v", b, bars)
				seen[b] = true
			}
			// Every point of the TTFT panel lies inside it.
			for _, m := range regexp.MustCompile(`<circle cx="([0-9.]+)" cy="([0-9.]+)"`).FindAllStringSubmatch(svg, -1) {
				cx, _ := strconv.ParseFloat(m[1], 64)
				cy, _ := strconv.ParseFloat(m[2], 64)
				assert.True(t, cx >= leftX && cx <= leftX+panelW && cy >= topY && cy <= topY+panelH, "point %s,%s outside the panel", m[1], m[2])
			}
		})
	}
}

// TestHelpExitsZero: `demo --help` prints a description and the flags on
// stdout and exits 0; a bad flag is one line on stderr with a hint, exit 1.
func TestHelpExitsZero(t *testing.T) {
	exe, err := os.Executable()
	require.NoError(t, err)
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), "BIDIKV_DEMO_MAIN=--help")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "exit status 0: %s", stderr.String())
	assert.True(t, strings.HasPrefix(stdout.String(), "Usage: go run ./examples/demo [flags]\n\nThe demo shows, with no GPU,"), stdout.String())
	assert.Contains(t, stdout.String(), "\nFlags:\n")
	assert.Contains(t, stdout.String(), "-suffix-tokens int")
	assert.Empty(t, stderr.String())

	cmd = exec.Command(exe)
	cmd.Env = append(os.Environ(), "BIDIKV_DEMO_MAIN=--nope")
	stdout.Reset()
	stderr.Reset()
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err = cmd.Run()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee)
	assert.Equal(t, 1, ee.ExitCode())
	assert.Equal(t, "demo: flag provided but not defined: -nope; go run ./examples/demo --help lists the flags\n", stderr.String())
	assert.Empty(t, stdout.String())
}

func TestParseFlagsErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"unknown profile", []string{"--profile", "llama"}, "unknown profile"},
		{"no conversations", []string{"--conversations", "0"}, "--conversations"},
		{"two turns", []string{"--turns", "2"}, "--turns"},
		{"verification", []string{"--verification", "bytes"}, "--verification"},
		{"no concurrency", []string{"--concurrency", "0"}, "--concurrency"},
		{"too short", []string{"--max-tokens", "2100"}, "--max-tokens"},
		{"argument", []string{"extra"}, "unexpected argument"},
		{"pause", []string{"--pause", "5 minutes"}, "--pause"},
		{"negative pause", []string{"--pause", "-1s"}, "--pause"},
		{"jitter", []string{"--pause-jitter", "1"}, "--pause-jitter"},
		{"negative suffix", []string{"--suffix-tokens", "-1"}, "--suffix-tokens"},
		{"suffix does not fit", []string{"--suffix-tokens", "3000", "--turns", "12"}, "--suffix-tokens"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseFlags(tt.args, io.Discard)
			require.Error(t, err)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

func TestPercentiles(t *testing.T) {
	ms := func(n ...int) []time.Duration {
		var out []time.Duration
		for _, v := range n {
			out = append(out, time.Duration(v)*time.Millisecond)
		}
		return out
	}
	hundred := make([]int, 100)
	for i := range hundred {
		hundred[i] = 100 - i // reversed: percentiles must sort
	}
	tests := []struct {
		name string
		in   []time.Duration
		want [3]time.Duration
	}{
		{"empty", nil, [3]time.Duration{}},
		{"one", ms(7), [3]time.Duration(ms(7, 7, 7))},
		{"hundred", ms(hundred...), [3]time.Duration(ms(50, 95, 99))},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, percentiles(tt.in))
		})
	}
}

func TestConversationReachesTargets(t *testing.T) {
	c, err := parseFlags([]string{"--turns", "4"}, io.Discard)
	require.NoError(t, err)
	cv := newConversation(3, c)
	for turn := range c.turns {
		body, err := cv.next(turn)
		require.NoError(t, err)
		n := countTokens(t, body)
		assert.InDelta(t, cv.targets[turn], n, 8, "turn %d", turn)
		cv.hear("Done. Next I will run the tests.")
	}
	assert.Equal(t, c.startTokens, cv.targets[1])
	assert.Equal(t, c.endTokens, cv.targets[c.turns-1])
	assert.Less(t, cv.targets[0], c.startTokens)
}

func TestSVGWellFormed(t *testing.T) {
	s := summary{profile: "qwen3-32b", buckets: []bucket{
		{turn: 0, tokens: 2000, offP: [3]time.Duration{100e6, 110e6, 120e6}, onP: [3]time.Duration{100e6, 110e6, 120e6}, on: []turn{{}}, off: []turn{{}}, offRecompute: 90e6, onRecompute: 90e6},
		{turn: 1, tokens: 4000, offP: [3]time.Duration{200e6, 210e6, 220e6}, onP: [3]time.Duration{120e6, 130e6, 140e6}, on: []turn{{}}, off: []turn{{}}, offRecompute: 190e6, onRecompute: 90e6, onTransfer: 20e6},
	}}
	var buf bytes.Buffer
	require.NoError(t, writeSVG(&buf, s))
	assertWellFormed(t, buf.Bytes())
	assert.Equal(t, 2, strings.Count(buf.String(), "<polyline")/2, "p50 and p95 lines per mode")
}

func assertWellFormed(t *testing.T, raw []byte) {
	t.Helper()
	dec := xml.NewDecoder(bytes.NewReader(raw))
	for {
		_, err := dec.Token()
		if err == io.EOF {
			return
		}
		require.NoError(t, err)
	}
}

func countTokens(t *testing.T, body []byte) int {
	t.Helper()
	n, err := kvroutetest.CountTokens(kvroute.PathChatCompletions, body)
	require.NoError(t, err)
	return n
}

// TestSuffixTokensDecodeLocal runs --suffix-tokens with and without
// --decode-local: with 300 new tokens a turn the modelled engine TTFT p50
// at the longest prompt is at least 2× lower decode-local, with 4000 it is
// no more than 5% higher, and no answer differs from a single engine's.
func TestSuffixTokensDecodeLocal(t *testing.T) {
	if testing.Short() {
		t.Skip("runs eight short demos")
	}
	last := func(args ...string) (time.Duration, summary) {
		c, err := parseFlags(append([]string{"--conversations", "2", "--quiet"}, args...), io.Discard)
		require.NoError(t, err)
		s, err := run(context.Background(), c, nil)
		require.NoError(t, err)
		assert.Zero(t, s.wrong, "%v", args)
		b := s.buckets[len(s.buckets)-1]
		ds := make([]time.Duration, len(b.on))
		for i, tr := range b.on {
			ds[i] = tr.engines() + tr.render // modelled: without the measured router overhead
		}
		return percentiles(ds)[0], s
	}
	for _, profile := range []string{"qwen3-32b", "glm-5-fp8"} {
		t.Run(profile, func(t *testing.T) {
			local, s := last("--profile", profile, "--suffix-tokens", "300")
			plain, _ := last("--profile", profile, "--suffix-tokens", "300", "--decode-local=false")
			t.Logf("300 new tokens: decode-local %v, pull %v", local, plain)
			assert.LessOrEqual(t, 2*local, plain)
			assert.Positive(t, s.paths[threshold.PathLocal])
			assert.Empty(t, s.published)

			local, _ = last("--profile", profile, "--suffix-tokens", "4000")
			plain, _ = last("--profile", profile, "--suffix-tokens", "4000", "--decode-local=false")
			t.Logf("4000 new tokens: decode-local %v, pull %v", local, plain)
			assert.LessOrEqual(t, float64(local), 1.05*float64(plain))
		})
	}
}

// TestPauseCrossesTTL: think times below the retention TTL keep every
// later turn a hit; above it every later turn finds its handle expired and
// runs as a plain prefill, with the answers still right.
func TestPauseCrossesTTL(t *testing.T) {
	if testing.Short() {
		t.Skip("runs a short demo")
	}
	c, err := parseFlags([]string{"--conversations", "2", "--quiet", "--pause", "300s,460s"}, io.Discard)
	require.NoError(t, err)
	s, err := run(context.Background(), c, nil)
	require.NoError(t, err)
	require.Len(t, s.pauses, 2)
	below, above := s.pauses[0], s.pauses[1]
	assert.Equal(t, 2*(c.turns-1), below.later)
	assert.Equal(t, below.later, below.reused)
	assert.Zero(t, below.expired)
	assert.Zero(t, above.reused)
	assert.Equal(t, above.later, above.expired)
	assert.Zero(t, below.wrong+above.wrong)
	// Modelled engine time: the router's measured overhead follows the
	// machine's load (-race, other tests), not the path.
	assert.Greater(t, above.modelled, below.modelled, "plain prefills are slower")
	assert.Positive(t, below.heldPeak)
	var out bytes.Buffer
	s.printPauses(&out)
	assert.Contains(t, out.String(), "Think time between turns")
}

// The peak KV held on decode is reported against the profile's decode node
// capacity (kvroutetest.Profile.KVCapacityTokens) and flagged above it.
func TestHeldAgainstCapacity(t *testing.T) {
	for _, name := range []string{"qwen3-32b", "glm-5-fp8"} {
		c, err := parseFlags([]string{"--profile", name}, io.Discard)
		require.NoError(t, err)
		p, _ := kvroutetest.LookupProfile(name)
		require.Positive(t, p.KVCapacityTokens)
		assert.Equal(t, p.KVCapacityTokens, c.capacity, name)
		assert.Equal(t, float64(p.KVBytesPerToken), c.kvBytes, name)
		for _, tt := range []struct {
			peak int
			over bool
		}{{p.KVCapacityTokens / 10, false}, {p.KVCapacityTokens, false}, {p.KVCapacityTokens + 1, true}} {
			s := summarize(c, modeResult{}, modeResult{reuse: true, peakHeldToks: tt.peak})
			s.pauses = []pauseRow{{pause: time.Minute, heldPeak: tt.peak}}
			var out bytes.Buffer
			s.print(&out)
			s.printPauses(&out)
			assert.Contains(t, out.String(), "of one "+name+" decode node's KV capacity, "+s.capacityString(), name)
			assert.Equal(t, tt.over, strings.Contains(out.String(), "OVER CAPACITY: the holds alone exceed"), "%s peak %d", name, tt.peak)
			assert.Equal(t, tt.over, strings.Contains(out.String(), s.heldString(tt.peak)+" OVER CAPACITY"), "%s pause table", name)
		}
	}
}

// The bar, when drawn (stderr is a terminal), redraws one line as the
// percentage moves and ends it after the last turn.
func TestProgressBar(t *testing.T) {
	var b bytes.Buffer
	p := &progress{w: &b, total: 4}
	p.setLabel("reuse off")
	for range 4 {
		p.tick()
	}
	assert.Equal(t, 4, strings.Count(b.String(), "\r["))
	assert.Contains(t, b.String(), "4/4 turns  reuse off")
	assert.True(t, strings.HasSuffix(b.String(), "\n"))
	silent := &progress{total: 2}
	silent.tick()
	silent.tick()
	assert.Equal(t, 2, silent.done, "a silent bar still counts")
}
