package main

import (
	"encoding/json"
	"net/http"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// waitLog waits, bounded, until the proxy's log matches re n times.
func waitLog(t *testing.T, p *inproc, re *regexp.Regexp, n int) []string {
	t.Helper()
	for range 1000 {
		if m := re.FindAllString(p.stderr.String(), -1); len(m) >= n {
			return m
		}
		time.Sleep(10 * time.Millisecond)
	}
	require.FailNow(t, "log line not seen", "%s x%d in\n%s", re, n, p.stderr.String())
	return nil
}

var capLine = regexp.MustCompile(`(?m)^.*msg="engine capabilities" role=(\w+) endpoint=(\S+) summary=.*$`)

// TestStartupCapabilities: engines found with render routes off (no
// --enable-scale-out) and, on D, prefix caching off: the proxy logs one
// line per engine saying what works and what does not and why, one
// warning per gap that names the flag or API and its fix, /ready returns
// the same facts per engine (today's fields kept) and /metrics a gauge per
// capability per engine.
func TestStartupCapabilities(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithRenderRoutes(false))
	d := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(cl.Registry), kvroutetest.WithRenderRoutes(false),
		kvroutetest.WithPrefixCaching(false), kvroutetest.WithBlockSize(32))
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", d.URL(), "--decode-local")

	lines := waitLog(t, p, capLine, 2)
	// The gaps follow the lines, in one round, decode-local's last.
	waitLog(t, p, regexp.MustCompile(`msg="engines: --decode-local`), 1)
	log := p.stderr.String()
	assert.Len(t, capLine.FindAllString(log, -1), 2, "one line per engine:\n%s", log)
	for _, l := range lines {
		assert.Contains(t, l, "missing: render (404: route not registered (vllm serve without --enable-scale-out))")
		assert.Contains(t, l, "works: version")
		assert.Contains(t, l, "vLLM "+kvroutetest.DefaultVersion)
	}
	assert.Contains(t, log, "prefix_caching (vllm:cache_config_info enable_prefix_caching=False)")

	for _, want := range []string{
		`level=WARN msg="engines: --verification tokens: prefill engine ` + cl.Prefill[0].URL() + ` has no render routes (POST /v1/chat/completions/render: 404: route not registered (vllm serve without --enable-scale-out)): Responses and Messages turns are never reused;`,
		`fix="start the engine with ` + "`vllm serve ... --enable-scale-out`",
		`level=WARN msg="engines: --decode-local: decode engine ` + d.URL() + ` runs without prefix caching`,
		`fix="start the engine without --no-enable-prefix-caching, or drop --decode-local"`,
		`level=INFO msg="engines: the engines report different block sizes (16 on ` + cl.Prefill[0].URL() + `, 32 on ` + d.URL() + `): each engine's handles are checked at its own`,
		`level=WARN msg="engines: streamed Messages turns (Claude Code) are never reused: vLLM's Messages streams carry no kv_transfer_params" fix="--decode-stream buffered`,
		`level=INFO msg="engines: streamed chat and completions turns are reused only when the decode engines put the handle on a stream's final chunk (vLLM PR #40186)`,
	} {
		assert.Contains(t, log, want)
	}
	assert.Equal(t, 1, strings.Count(log, "has no render routes"), "each gap once")

	status, _, body := p.do(t, http.MethodGet, "/ready", "")
	assert.Equal(t, http.StatusOK, status)
	var ready struct {
		Ready, Prefill, Decode bool
		Engines                []struct {
			Role, Endpoint string
			Up             bool
			Capabilities   *capability.Report
		}
	}
	require.NoError(t, json.Unmarshal([]byte(body), &ready), body)
	assert.True(t, ready.Ready && ready.Prefill && ready.Decode)
	require.Len(t, ready.Engines, 2)
	for _, e := range ready.Engines {
		require.NotNil(t, e.Capabilities, e.Endpoint)
		assert.True(t, e.Up)
		assert.True(t, e.Capabilities.Render.Chat.Is(capability.Absent))
		assert.Contains(t, e.Capabilities.Render.Chat.Fix, "--enable-scale-out")
	}
	assert.Equal(t, "decode", ready.Engines[1].Role)
	assert.True(t, ready.Engines[1].Capabilities.PrefixCaching.Is(capability.Absent))
	assert.Equal(t, 32, ready.Engines[1].Capabilities.BlockSize)

	for sample, want := range map[string]string{
		`bidikv_engine_capability{capability="render_chat",endpoint="` + d.URL() + `",role="decode"}`:                                 "0",
		`bidikv_engine_capability{capability="tokenize",endpoint="` + d.URL() + `",role="decode"}`:                                    "1",
		`bidikv_engine_capability{capability="stream_handles_chat",endpoint="` + d.URL() + `",role="decode"}`:                         "-1",
		`bidikv_engine_capability{capability="prefix_caching",endpoint="` + cl.Prefill[0].URL() + `",role="prefill"}`:                 "1",
		`bidikv_engine_block_size{endpoint="` + d.URL() + `",role="decode"}`:                                                          "32",
		`bidikv_engine_info{endpoint="` + d.URL() + `",model="sim-model",role="decode",version="` + kvroutetest.DefaultVersion + `"}`: "1",
	} {
		assert.Equal(t, want, p.metric(t, sample), sample)
	}
}

// Issue 24, item 1: what turns show of the engines reaches the proxy's
// report: after a streamed chat turn on a stock decode engine (no handle
// in its streams), the next health round's capability line, gap warning,
// /ready and gauge say so, with the fix.
func TestLearnedCapabilitiesReported(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	d := cl.Decode[0].URL()
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", d, "--health-interval", "10ms")
	waitLog(t, p, capLine, 2)
	status, _, body := p.do(t, http.MethodPost, "/v1/chat/completions",
		`{"model":"sim-model","max_tokens":4,"stream":true,"messages":[{"role":"user","content":"hi"}]}`)
	require.Equal(t, http.StatusOK, status, body)

	waitLog(t, p, regexp.MustCompile(`msg="engine capabilities" role=decode endpoint=\S+ summary="[^"]*missing: [^"]*stream_handles_chat \(learned: a chat stream ended normally without a handle\)`), 1)
	waitLog(t, p, regexp.MustCompile(`level=WARN msg="engines: decode engine \S+: streamed chat turns are never reused: learned: a chat stream ended normally without a handle" fix="apply vLLM PR #40186`), 1)
	status, _, body = p.do(t, http.MethodGet, "/ready", "")
	require.Equal(t, http.StatusOK, status)
	var ready struct {
		Engines []struct {
			Role         string
			Capabilities *capability.Report
		}
	}
	require.NoError(t, json.Unmarshal([]byte(body), &ready), body)
	require.Len(t, ready.Engines, 2)
	for _, e := range ready.Engines {
		if e.Role == "decode" {
			assert.True(t, e.Capabilities.StreamHandles.Chat.Is(capability.Absent), body)
			assert.True(t, e.Capabilities.Bidirectional.Is(capability.Unknown), "a stream without a handle does not show the transfer: %s", body)
		}
	}
	assert.Equal(t, "0", p.metric(t, `bidikv_engine_capability{capability="stream_handles_chat",endpoint="`+d+`",role="decode"}`))
}
