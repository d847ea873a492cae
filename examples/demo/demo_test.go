package main

import (
	"bytes"
	"context"
	"encoding/xml"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// TestPublishedShape runs a shortened demo per profile and checks the
// published shape: the off/on TTFT ratio at the longest prompt, a flat
// "on" curve, every later turn a hit, and answers identical to a single
// engine's.
func TestPublishedShape(t *testing.T) {
	if testing.Short() {
		t.Skip("runs two short demos")
	}
	tests := []struct {
		profile  string
		end      int
		minRatio float64
	}{
		{"qwen3-32b", 24000, 1.5},
		{"glm-5-fp8", 20000, 3},
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			c, err := parseFlags([]string{"--profile", tt.profile, "--conversations", "1", "--turns", "12", "--quiet"}, io.Discard)
			require.NoError(t, err)
			require.Equal(t, tt.end, c.endTokens)
			s, err := run(context.Background(), c, nil)
			require.NoError(t, err)

			ratio, ok := s.ratioAt(tt.end)
			require.True(t, ok, "no bucket at %d tokens", tt.end)
			assert.GreaterOrEqual(t, ratio, tt.minRatio)
			first, last := s.buckets[0], s.buckets[len(s.buckets)-1]
			assert.Less(t, last.onP[0]-first.onP[0], (last.offP[0]-first.offP[0])/3,
				"the reuse-on curve should be far flatter than the reuse-off one")
			assert.InDelta(t, 11.0/12, s.hitRate, 1e-9, "every turn after the first should hit")
			assert.Zero(t, s.wrong)
			assert.Less(t, last.recomputed, 0.5, "with reuse most of a long prompt is pulled, not recomputed")
			assert.Positive(t, last.heldTokens)
		})
	}
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
	assert.Contains(t, errOut.String(), "6/6 turns", "progress bar")
	raw, err := os.ReadFile(svg)
	require.NoError(t, err)
	assertWellFormed(t, raw)
	assert.Contains(t, string(raw), "reuse on")
}

func TestParseFlagsErrors(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want string
	}{
		{"unknown profile", []string{"--profile", "llama"}, "unknown profile"},
		{"no conversations", []string{"--conversations", "0"}, "--conversations"},
		{"one turn", []string{"--turns", "1"}, "--turns"},
		{"no concurrency", []string{"--concurrency", "0"}, "--concurrency"},
		{"too short", []string{"--max-tokens", "2100"}, "--max-tokens"},
		{"argument", []string{"extra"}, "unexpected argument"},
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
	assert.Equal(t, c.endTokens, cv.targets[c.turns-1])
}

func TestSVGWellFormed(t *testing.T) {
	s := summary{profile: "qwen3-32b", buckets: []bucket{
		{tokens: 2000, offP: [3]time.Duration{100e6, 110e6, 120e6}, onP: [3]time.Duration{100e6, 110e6, 120e6}, on: []turn{{}}, off: []turn{{}}, offRecompute: 90e6, onRecompute: 90e6},
		{tokens: 4000, offP: [3]time.Duration{200e6, 210e6, 220e6}, onP: [3]time.Duration{120e6, 130e6, 140e6}, on: []turn{{}}, off: []turn{{}}, offRecompute: 190e6, onRecompute: 90e6, onTransfer: 20e6},
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
