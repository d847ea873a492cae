package main

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"testing"
	"unicode"
	"unicode/utf8"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// doctorJSON is what --json prints.
type doctorJSON struct {
	Engines []struct {
		Role, Endpoint string
	}
	APIs []struct {
		API, Verification, Handles, Reuse string
		StreamHandles                     string `json:"stream_handles"`
		StreamedReuse                     string `json:"streamed_reuse"`
		Why, Fix                          string
	}
	Gaps []struct {
		Severity, What, Fix string
	}
	Probe []struct {
		API     string
		Stream  bool
		Turns   int
		Reused  int
		Equal   int
		Note    string
		Meaning string `json:"note_meaning"`
	}
	Works     bool `json:"reuse_works"`
	NoCompute bool `json:"ttft_models_no_compute"`
	Verdict   string
}

// doctor runs `bidikv-proxy doctor` in-process against one prefill and one
// decode engine and returns its JSON report and error.
func doctor(t *testing.T, p, d *kvroutetest.Engine, args ...string) (doctorJSON, error, string) {
	t.Helper()
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	args = append([]string{"doctor", "--json", "--prefill", p.URL(), "--decode", d.URL()}, args...)
	err := run(context.Background(), args, noEnv, stdout, stderr)
	var out doctorJSON
	require.NoError(t, json.Unmarshal([]byte(stdout.String()), &out), "%s\n%s", stdout, stderr)
	return out, err, stdout.String()
}

// reuse maps each API to "reuse/streamed".
func (d doctorJSON) reuse() map[string]string {
	m := map[string]string{}
	for _, a := range d.APIs {
		m[a.API] = a.Reuse + "/" + a.StreamedReuse
	}
	return m
}

// TestDoctorConfigurations runs the doctor against the simulated engines in
// each capability configuration a stock vLLM can be found in: what it says
// works per API, the gaps it names with their fixes, its exit status, and
// with --probe what real turns through an in-process router show.
func TestDoctorConfigurations(t *testing.T) {
	const (
		ok  = "present"
		no  = "absent"
		unk = "unknown"
	)
	all := func(s string) map[string]string {
		return map[string]string{"chat": s, "completions": s, "responses": s, "messages": s}
	}
	cases := []struct {
		name     string
		p, d     []kvroutetest.Option // each engine's options (both: shared)
		both     []kvroutetest.Option
		args     []string
		fail     bool              // exit status 1
		reuse    map[string]string // API: reuse/streamed
		gaps     []string          // substrings of gaps, each with a fix
		notGaps  []string          // substrings no gap has
		fixes    []string
		probe    map[string][3]int // "api mode": turns answered, reused turns, equal answers
		verdicts string
	}{
		{name: "everything, stream handles on", both: []kvroutetest.Option{kvroutetest.WithStreamHandles(true)},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": ok + "/" + ok, "messages": ok + "/" + no},
			gaps:  []string{"streamed Messages turns (Claude Code) are never reused"}, fixes: []string{"--decode-stream buffered"}},
		{name: "probe: everything, stream handles on", both: []kvroutetest.Option{kvroutetest.WithStreamHandles(true)}, args: []string{"--probe"},
			reuse: map[string]string{"chat": ok + "/" + ok, "completions": ok + "/" + ok, "responses": ok + "/" + ok, "messages": ok + "/" + no},
			probe: map[string][3]int{"chat body": {3, 2, 2}, "chat stream": {3, 2, 2}, "completions body": {3, 2, 2}, "completions stream": {3, 2, 2},
				"responses body": {3, 2, 2}, "responses stream": {3, 2, 2}, "messages body": {3, 2, 2}, "messages stream": {3, 0, 0}}},
		{name: "probe: stock streams (no PR #40186)", args: []string{"--probe"},
			// response.completed carries the handle on stock engines (PR #37424)
			reuse: map[string]string{"chat": ok + "/" + no, "completions": ok + "/" + no, "responses": ok + "/" + ok, "messages": ok + "/" + no},
			gaps:  []string{"decode engine", "streamed chat turns are never reused: learned: a chat stream ended normally without a handle"},
			fixes: []string{"apply vLLM PR #40186 on the decode engines", "--decode-stream buffered"},
			probe: map[string][3]int{"chat body": {3, 2, 2}, "chat stream": {3, 0, 0}, "responses stream": {3, 2, 2}, "messages body": {3, 2, 2}, "messages stream": {3, 0, 0}}},
		{name: "render 404 (no --enable-scale-out)", both: []kvroutetest.Option{kvroutetest.WithRenderRoutes(false)},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": no + "/" + no, "messages": no + "/" + no},
			gaps:  []string{"has no render routes (POST /v1/chat/completions/render: 404: route not registered (vllm serve without --enable-scale-out)): Responses and Messages turns are never reused"},
			fixes: []string{"`vllm serve ... --enable-scale-out`"}},
		{name: "probe: render 404", both: []kvroutetest.Option{kvroutetest.WithRenderRoutes(false), kvroutetest.WithStreamHandles(true)}, args: []string{"--probe"},
			reuse: map[string]string{"chat": ok + "/" + ok, "completions": ok + "/" + ok, "responses": no + "/" + no, "messages": no + "/" + no},
			probe: map[string][3]int{"chat body": {3, 2, 2}, "chat stream": {3, 2, 2}, "completions body": {3, 2, 2}, "responses body": {3, 0, 0}, "messages body": {3, 0, 0}}},
		{name: "render 501 (no renderer)", both: []kvroutetest.Option{kvroutetest.WithRenderer(false)},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": no + "/" + no, "messages": no + "/" + no},
			gaps:  []string{"501: no renderer for this API"}, fixes: []string{"renderer"}},
		{name: "render 404 and no /tokenize: content rules for chat", both: []kvroutetest.Option{kvroutetest.WithRenderRoutes(false), kvroutetest.WithTokenize(false)},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": no + "/" + no, "messages": no + "/" + no},
			gaps:  []string{"serves neither the render routes"}},
		{name: "probe: Responses handles off (before PR #37424)", both: []kvroutetest.Option{kvroutetest.WithResponsesKV(false), kvroutetest.WithStreamHandles(true)},
			args:  []string{"--probe"},
			reuse: map[string]string{"chat": ok + "/" + ok, "completions": ok + "/" + ok, "responses": no + "/" + no, "messages": ok + "/" + no},
			gaps:  []string{"learned: the prefill engine answered a Responses request without a handle: Responses turns fail with 502"},
			fixes: []string{"--local-prefill-fallback"},
			probe: map[string][3]int{"responses body": {0, 0, 0}, "responses stream": {0, 0, 0}, "chat body": {3, 2, 2}}},
		{name: "probe: Responses handles off, --local-prefill-fallback", both: []kvroutetest.Option{kvroutetest.WithResponsesKV(false)},
			args:  []string{"--probe", "--local-prefill-fallback"},
			reuse: map[string]string{"chat": ok + "/" + no, "completions": ok + "/" + no, "responses": no + "/" + no, "messages": ok + "/" + no},
			gaps:  []string{"Responses turns are never reused"},
			probe: map[string][3]int{"responses body": {3, 0, 0}, "chat body": {3, 2, 2}}},
		{name: "probe: Messages handles off (before PR #37535)", both: []kvroutetest.Option{kvroutetest.WithMessagesKV(false), kvroutetest.WithStreamHandles(true)}, args: []string{"--probe"},
			reuse: map[string]string{"chat": ok + "/" + ok, "completions": ok + "/" + ok, "responses": ok + "/" + ok, "messages": no + "/" + no},
			probe: map[string][3]int{"messages body": {0, 0, 0}, "messages stream": {0, 0, 0}, "responses body": {3, 2, 2}}},
		{name: "Responses and Messages handles off by version", both: []kvroutetest.Option{kvroutetest.WithVersion("0.18.1")}, fail: true,
			gaps: []string{"predates bidirectional_kv_xfer"}, fixes: []string{"upgrade vLLM to 0.21.0 or later"}},
		{name: "prefix caching off on D, --decode-local", d: []kvroutetest.Option{kvroutetest.WithPrefixCaching(false)}, args: []string{"--decode-local"},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": ok + "/" + ok, "messages": ok + "/" + no},
			gaps:  []string{"--decode-local: decode engine"}, fixes: []string{"start the engine without --no-enable-prefix-caching, or drop --decode-local"}},
		{name: "prefix caching off on P only: fine", p: []kvroutetest.Option{kvroutetest.WithPrefixCaching(false)}, args: []string{"--decode-local"},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": ok + "/" + ok, "messages": ok + "/" + no}},
		{name: "probe: engines of block size 64, default flags", both: []kvroutetest.Option{kvroutetest.WithBlockSize(64), kvroutetest.WithStreamHandles(true)},
			args:    []string{"--probe"},
			reuse:   map[string]string{"chat": ok + "/" + ok, "completions": ok + "/" + ok, "responses": ok + "/" + ok, "messages": ok + "/" + no},
			notGaps: []string{"block size", "block_size"},
			probe:   map[string][3]int{"chat body": {3, 2, 2}, "chat stream": {3, 2, 2}, "completions body": {3, 2, 2}, "responses body": {3, 2, 2}, "messages body": {3, 2, 2}}},
		{name: "--block-size other than the engines'", both: []kvroutetest.Option{kvroutetest.WithBlockSize(32)}, args: []string{"--block-size", "16"},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": ok + "/" + ok, "messages": ok + "/" + no},
			gaps:  []string{"warn: --block-size 16, but decode engine", "reports block_size 32: its own is used for its handles"},
			fixes: []string{"--block-size 0 (the default: each engine's own, read from its /metrics)"}},
		{name: "block size matched by the flag", both: []kvroutetest.Option{kvroutetest.WithBlockSize(32)}, args: []string{"--block-size", "32"},
			reuse:   map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": ok + "/" + ok, "messages": ok + "/" + no},
			notGaps: []string{"block size", "block_size"}},
		{name: "P and D block sizes differ", p: []kvroutetest.Option{kvroutetest.WithBlockSize(32)},
			gaps: []string{"the engines report different block sizes"}, fixes: []string{"the same --block-size on every engine"},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": ok + "/" + ok, "messages": ok + "/" + no}},
		{name: "mismatched versions between P and D", p: []kvroutetest.Option{kvroutetest.WithVersion("0.29.0")}, fail: true,
			gaps:  []string{"prefill engines run vLLM 0.29.0, decode engines " + kvroutetest.DefaultVersion},
			fixes: []string{"run the same vLLM version on every prefill and decode engine"}},
		{name: "--verification content", args: []string{"--verification", "content"},
			reuse: map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": no + "/" + no, "messages": no + "/" + no},
			gaps:  []string{"--verification content: Responses and Messages turns are never reused"}},
		{name: "probe: bidirectional off", both: []kvroutetest.Option{kvroutetest.WithBidirectional(false)}, args: []string{"--probe"}, fail: true,
			gaps:  []string{"learned: the decode engine answered a request carrying P's handle without one"},
			fixes: []string{`"kv_connector_extra_config":{"bidirectional_kv_xfer":true}`}},
		{name: "stock streams, --decode-stream buffered", args: []string{"--decode-stream", "buffered"},
			reuse:   all(ok + "/" + ok),
			gaps:    []string{"--decode-stream buffered: streamed Messages turns", "--decode-stream buffered: streamed chat turns"},
			notGaps: []string{"never reused", "PR #40186"}},
		{name: "stock streams, --decode-stream buffered:messages", args: []string{"--decode-stream", "buffered:messages"},
			reuse:   map[string]string{"chat": ok + "/" + unk, "completions": ok + "/" + unk, "responses": ok + "/" + ok, "messages": ok + "/" + ok},
			gaps:    []string{"--decode-stream buffered: streamed Messages turns", "PR #40186"},
			notGaps: []string{"streamed Messages turns (Claude Code) are never reused", "buffered: streamed chat"}},
		{name: "probe: stock streams, --decode-stream buffered", args: []string{"--probe", "--decode-stream", "buffered"},
			notGaps: []string{"streamed Messages turns (Claude Code) are never reused", "streamed chat turns are never reused", "streamed completions turns are never reused"},
			probe: map[string][3]int{"chat body": {3, 2, 2}, "chat stream": {3, 1, 1}, "completions stream": {3, 1, 1},
				"messages body": {3, 2, 2}, "messages stream": {3, 2, 2}}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			reg := kvroutetest.NewRegistry()
			p := kvroutetest.NewEngine(t, append(append([]kvroutetest.Option{kvroutetest.WithRegistry(reg)}, tc.both...), tc.p...)...)
			d := kvroutetest.NewEngine(t, append(append([]kvroutetest.Option{kvroutetest.WithRegistry(reg)}, tc.both...), tc.d...)...)
			out, err, raw := doctor(t, p, d, tc.args...)
			if tc.fail {
				assert.True(t, errors.Is(err, errNoReuse), "%v\n%s", err, raw)
				assert.False(t, out.Works)
			} else {
				assert.NoError(t, err, raw)
				assert.True(t, out.Works, raw)
			}
			if tc.reuse != nil {
				assert.Equal(t, tc.reuse, out.reuse(), raw)
			}
			var gapText string
			for _, g := range out.Gaps {
				gapText += g.Severity + ": " + g.What + "\n  fix: " + g.Fix + "\n"
				assert.NotEmpty(t, g.Fix, "a gap without a fix: %s", g.What)
			}
			for _, s := range tc.gaps {
				assert.Contains(t, gapText, s)
			}
			for _, s := range tc.fixes {
				assert.Contains(t, gapText, s)
			}
			for _, s := range tc.notGaps {
				assert.NotContains(t, gapText, s)
			}
			for key, want := range tc.probe {
				found := false
				for _, r := range out.Probe {
					mode := "body"
					if r.Stream {
						mode = "stream"
					}
					if r.API+" "+mode == key {
						found = true
						assert.Equal(t, want, [3]int{r.Turns, r.Reused, r.Equal}, "%s: %s", key, r.Note)
					}
				}
				assert.True(t, found, key)
			}
			if tc.probe != nil {
				assert.Len(t, out.Probe, 8, "every API, streaming and not")
			}
			_ = all
		})
	}
}

// TestDoctorText: the report as a new user reads it, render routes off:
// each engine's facts, the per-API table, each gap with its fix, and the
// verdict; exit status 0 (chat and completions still reuse).
func TestDoctorText(t *testing.T) {
	reg := kvroutetest.NewRegistry()
	p := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithRenderRoutes(false))
	d := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithRenderRoutes(false))
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	err := run(context.Background(), []string{"doctor", "--prefill", p.URL(), "--decode", d.URL()}, noEnv, stdout, stderr)
	require.NoError(t, err, stderr.String())
	out := stdout.String()
	for _, want := range []string{
		"bidikv-proxy doctor: 1 prefill engine and 1 decode engine; --verification tokens, --block-size 0 (each engine's own), --recompute-threshold 64\n",
		"prefill " + p.URL() + "\ndecode " + d.URL() + "\n  vLLM " + kvroutetest.DefaultVersion + ", model sim-model, KV 131k tokens (8193 blocks of 16)\n" +
			"  block size 16, the engine's: its handles are checked and cut at it\n",
		"  render                      NO       404: route not registered (vllm serve without --enable-scale-out)\n",
		"  tokenize                    ok       POST /tokenize: 200\n",
		"per API\n  API          verification  handles  stream handles  reuse  streamed reuse  why not\n",
		"  chat         /tokenize     ok       unknown         ok     unknown         streams: not observable by a probe",
		"  responses    none (NO)     ok       ok              NO     NO              render: POST /v1/responses/render: 404: route not registered (vllm serve without --enable-scale-out)\n",
		"  messages     none (NO)     ok       NO              NO     NO              render: POST /v1/messages/render: 404",
		"gaps and fixes\n  warn: --verification tokens: prefill engine " + p.URL() + " has no render routes",
		"    fix: start the engine with `vllm serve ... --enable-scale-out`",
		"  warn: streamed Messages turns (Claude Code) are never reused: vLLM's Messages streams carry no kv_transfer_params\n    fix: --decode-stream buffered",
		"\nreuse can work on chat, completions; not on responses, messages\n",
	} {
		assert.Contains(t, out, want)
	}
	assert.Empty(t, stderr.String())

	t.Run("an unreachable engine", func(t *testing.T) {
		stdout := &syncBuffer{}
		err := run(context.Background(), []string{"doctor", "--prefill", p.URL(), "--decode", "http://127.0.0.1:1"}, noEnv, stdout, io.Discard)
		assert.ErrorIs(t, err, errNoReuse)
		assert.Contains(t, stdout.String(), "decode http://127.0.0.1:1\n  unreachable: ")
		assert.Contains(t, stdout.String(), "reuse cannot work: an engine is unreachable")
	})
	t.Run("a bad command line", func(t *testing.T) {
		err := run(context.Background(), []string{"doctor", "--probe=maybe"}, noEnv, io.Discard, io.Discard)
		assert.ErrorIs(t, err, errUsage)
	})
}

// TestContentModePerAPI is what --verification content reuses, per API,
// measured through the doctor's probe on the simulated engines (stream
// handles on): chat turns that resend the conversation exactly, and
// completions turns whose prompt goes on from the stored prompt and reply
// at clean token seams (the probe's reply starts without a space after
// "Assistant:", a seam BPE tokenizers may merge, so none here); Responses
// and Messages turns never (they have no content rules).
func TestContentModePerAPI(t *testing.T) {
	reg := kvroutetest.NewRegistry()
	p := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithStreamHandles(true))
	d := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithStreamHandles(true))
	out, err, raw := doctor(t, p, d, "--probe", "--verification", "content")
	require.NoError(t, err, raw)
	got := map[string]int{}
	for _, r := range out.Probe {
		mode := "body"
		if r.Stream {
			mode = "stream"
		}
		got[r.API+" "+mode] = r.Reused
		assert.Equal(t, r.Reused, r.Equal, r.API)
	}
	assert.Equal(t, map[string]int{"chat body": 2, "chat stream": 2, "completions body": 0, "completions stream": 0,
		"responses body": 0, "responses stream": 0, "messages body": 0, "messages stream": 0}, got, raw)
}

// The doctor prints engines' words escaped: an engine whose version holds
// a terminal escape, a carriage return and a bidirectional override, and
// whose model name holds a line break and an invalid byte, cannot rewrite
// the terminal nor forge a line of the report.
func TestDoctorEscapesEngineStrings(t *testing.T) {
	reg := kvroutetest.NewRegistry()
	version := "0.9.0\x1b[2J\rok\u202e"
	p := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithVersion(version))
	d := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithVersion(version), kvroutetest.WithModel("sim\nreuse works on every API\xff"))
	stdout := &syncBuffer{}
	_ = run(context.Background(), []string{"doctor", "--prefill", p.URL(), "--decode", d.URL()}, noEnv, stdout, io.Discard)
	out := stdout.String()
	for _, r := range out {
		if r != '\n' && r != '\t' {
			require.False(t, unicode.IsControl(r) || unicode.Is(unicode.Cf, r) || r == utf8.RuneError, "the report holds %q", r)
		}
	}
	assert.True(t, strings.Contains(out, `vLLM 0.9.0\x1b[2J\rok\u202e`), "the version, escaped")
	// The invalid byte reaches the report as JSON decoding leaves it: U+FFFD.
	assert.True(t, strings.Contains(out, `model sim\nreuse works on every API\ufffd`), "the model, escaped")
	assert.False(t, strings.Contains(out, "\nreuse works on every API"), "a line forged by the model's name")
}
