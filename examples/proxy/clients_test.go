package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
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
)

// clientsDir is examples/clients: check.mjs and its pinned SDKs.
const clientsDir = "../clients"

// needClients returns the node binary for examples/clients/check.mjs. It
// skips the test when node (20 or later) or the installed SDKs
// (npm ci --prefix examples/clients) are missing, except in CI (CI=true),
// where it fails.
func needClients(t *testing.T) string {
	t.Helper()
	missing := func(format string, args ...any) string {
		if os.Getenv("CI") == "true" {
			t.Fatalf(format, args...)
		}
		t.Skipf(format, args...)
		return ""
	}
	node, err := exec.LookPath("node")
	if err != nil {
		return missing("node not installed: %v", err)
	}
	out, err := exec.Command(node, "--version").Output()
	if err != nil {
		return missing("node --version: %v", err)
	}
	major := 0
	if m := regexp.MustCompile(`^v(\d+)\.`).FindSubmatch(out); m != nil {
		major, _ = strconv.Atoi(string(m[1]))
	}
	if major < 20 {
		return missing("node %s is older than 20", bytes.TrimSpace(out))
	}
	for _, pkg := range []string{"openai", "@anthropic-ai/sdk"} {
		if _, err := os.Stat(filepath.Join(clientsDir, "node_modules", pkg, "package.json")); err != nil {
			return missing("%s not installed (npm ci --prefix examples/clients): %v", pkg, err)
		}
	}
	return node
}

// clientsReport is check.mjs --json.
type clientsReport struct {
	Versions struct{ OpenAI, Anthropic, Node string }
	Failed   int
	Rows     []struct {
		Run                 int
		Scenario            string
		Turns, Hits, Errors int
		Reasoning           int // turns that carried reasoning
		Failures            []string
	}
}

// runClients runs check.mjs against the proxy at base with extra flags.
func runClients(t *testing.T, node, base string, extra ...string) (clientsReport, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, append([]string{"check.mjs", base, "--json"}, extra...)...)
	cmd.Dir = clientsDir
	// The SDKs read their keys and base URLs from the environment only
	// when the code passes none; check.mjs passes both, and nothing else
	// of the environment's should reach them.
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "OPENAI_") && !strings.HasPrefix(kv, "ANTHROPIC_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	var rep clientsReport
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep), "check.mjs: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
	return rep, fmt.Sprintf("exit: %v\n%s%s", err, stdout.String(), stderr.String())
}

// The official OpenAI and Anthropic SDKs, unmodified, through the proxy
// (examples/clients/check.mjs): four-turn conversations on every API the
// proxy serves, streaming and not, with tools, each resending its history
// as agents do. Every turn parses in the SDK, equals a single engine's
// answer, carries no handle byte and hits from turn 2 where the proxy can
// reuse; malformed requests raise the SDKs' BadRequestError and a wrong
// key their AuthenticationError. A second tenant (another key) resending
// the first one's history through the SDKs, with the keys in either header,
// never reuses its KV, and the first tenant's own next turn does. The same on
// a reasoning model and with
// --decode-local; a run without the reference engine compares two
// identical runs instead.
func TestRealClients(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	node := needClients(t)
	t.Parallel() // slow: real processes
	p := startEngine(t, "--no-enable-prefix-caching")
	d := startEngine(t)
	ref := startEngine(t) // one engine, no disaggregation: the reference answers
	px := startProxy(t, p, d, "--api-key", "sk-clients", "--api-key", "sk-clients-b")

	rep, out := runClients(t, node, px.url, "--reference", ref.url, "--api-key", "sk-clients", "--second-key", "sk-clients-b")
	require.Zero(t, rep.Failed, out)
	assert.NotEmpty(t, rep.Versions.OpenAI, out)
	assert.NotEmpty(t, rep.Versions.Anthropic, out)
	turns := map[string]int{} // by API, over the conversations
	hits := map[string]int{}
	turns["anthropic messages"] = 1 // the X-Api-Key check: one more first turn
	conversations, tenants := 0, 0
	for _, r := range rep.Rows {
		assert.Zero(t, r.Errors, "%s: %v", r.Scenario, r.Failures)
		if name, ok := strings.CutPrefix(r.Scenario, "tenant: "); ok {
			// B resent A's history (a miss), then A's own turn (a hit).
			tenants++
			api := strings.Join(strings.Fields(name)[:2], " ")
			turns[api] += r.Turns
			hits[api] += r.Hits
			assert.Equal(t, 3, r.Turns, r.Scenario)
			assert.Equal(t, 1, r.Hits, "%s: only a's own turn hits", r.Scenario)
			continue
		}
		if strings.HasPrefix(r.Scenario, "error: ") || r.Turns == 1 {
			continue
		}
		conversations++
		api := strings.Fields(r.Scenario)[0] + " " + strings.Fields(r.Scenario)[1]
		turns[api] += r.Turns
		hits[api] += r.Hits
		assert.Equal(t, 4, r.Turns, r.Scenario)
		want := 3 // from turn 2
		if r.Scenario == "anthropic messages.stream" || r.Scenario == "anthropic beta.messages.stream" {
			want = 0 // vLLM's Messages streams carry no handle
		}
		assert.Equal(t, want, r.Hits, r.Scenario)
	}
	assert.Equal(t, 14, conversations, out)
	assert.Equal(t, 8, tenants, "four APIs, each with a's key by either header and b's by the other: %s", out)

	// The proxy counted the same turns and hits.
	_, page := get(t, px.url+"/metrics")
	for path, sc := range map[string][]string{
		"/v1/chat/completions": {"openai chat", "openai chat.completions.stream"},
		"/v1/completions":      {"openai completions"},
		"/v1/responses":        {"openai responses", "openai responses.stream"},
		"/v1/messages":         {"anthropic messages", "anthropic messages.stream", "anthropic beta.messages", "anthropic beta.messages.stream"},
	} {
		n, h := 0, 0
		for _, api := range sc {
			n += turns[api]
			h += hits[api]
		}
		ok := func(reuse string) int {
			v, _ := strconv.Atoi(metricValue(page, `bidikv_turns_total{path="`+path+`",result="ok",reuse="`+reuse+`"}`))
			return v
		}
		assert.Equal(t, h, ok("hit"), path)
		assert.Equal(t, n-h, ok("miss"), path)
	}
	assert.NotContains(t, px.stderr.String(), "You are a coding agent", "prompts never reach the logs")

	t.Run("reasoning", func(t *testing.T) {
		// A reasoning model: chat's reasoning field, Responses' reasoning
		// items and Messages' thinking blocks, each echoed back by the
		// agent as it came, and each equal to the single engine's.
		t.Parallel()
		p := startEngine(t, "--no-enable-prefix-caching", "--reasoning")
		d := startEngine(t, "--reasoning")
		ref := startEngine(t, "--reasoning")
		px := startProxy(t, p, d)
		rep, out := runClients(t, node, px.url, "--reference", ref.url)
		require.Zero(t, rep.Failed, out)
		reasoned := 0
		for _, r := range rep.Rows {
			if r.Reasoning == r.Turns && r.Turns == 4 {
				reasoned++
			}
		}
		assert.Equal(t, 12, reasoned, "every conversation but the completions ones reasoned on every turn: %s", out)
	})

	t.Run("decode-local", func(t *testing.T) {
		// Short turns answered by the decode engine from its own prefix
		// cache (X-Bidikv-Reuse: local, which check.mjs counts as reuse):
		// the same answers, through the same SDKs.
		t.Parallel()
		p := startEngine(t, "--no-enable-prefix-caching")
		d := startEngine(t)
		ref := startEngine(t)
		px := startProxy(t, p, d, "--decode-local")
		rep, out := runClients(t, node, px.url, "--reference", ref.url)
		require.Zero(t, rep.Failed, out)
		_, page := get(t, px.url+"/metrics")
		assert.NotEqual(t, "absent", metricValue(page, `bidikv_turns_total{path="/v1/chat/completions",result="ok",reuse="local"}`), "some turns were local")
	})

	t.Run("buffered", func(t *testing.T) {
		// Issue 24, item 3: engines as stock vLLM serves them (no handle
		// in any stream) and the proxy with --decode-stream buffered. The
		// SDKs' stream helpers (OpenAI chat.completions.stream, Anthropic
		// messages.stream and beta.messages.stream, as Claude Code calls
		// it) parse the buffered streams unchanged, every answer is the
		// reference engine's, and streamed chat, completions and Messages
		// conversations reuse KV: from turn 2, except the first chat and
		// the first completions stream, which showed the proxy the
		// engine's streams (from turn 3). Responses streams, never
		// buffered, carry their handle on response.completed (PR #37424).
		t.Parallel()
		stock := func(extra ...string) *proc {
			return start(t, "vllmsim", simReady, append([]string{"--port", "0", "--side-channel-port", "0", "--kv-transfer-config", kvConfig}, extra...)...)
		}
		p, d, ref := stock("--no-enable-prefix-caching"), stock(), stock()
		px := startProxy(t, p, d, "--decode-stream", "buffered")
		rep, out := runClients(t, node, px.url, "--reference", ref.url, "--buffered", "--no-stream-handles")
		require.Zero(t, rep.Failed, out)
		hits := map[string]int{}
		for _, r := range rep.Rows {
			hits[r.Scenario] = r.Hits
		}
		for sc, want := range map[string]int{
			"anthropic messages.stream": 3, "anthropic beta.messages.stream": 3,
			"openai chat stream usage": 2, "openai chat stream no usage": 3, "openai chat.completions.stream helper": 3,
			"openai completions stream": 2, "openai responses stream": 3, "anthropic messages": 3,
		} {
			assert.Equal(t, want, hits[sc], "%s: %s", sc, out)
		}
		_, page := get(t, px.url+"/metrics")
		assert.Equal(t, "8", metricValue(page, `bidikv_buffered_streams_total{path="/v1/messages"}`), "two streamed Messages conversations of four turns")
		assert.Equal(t, "11", metricValue(page, `bidikv_buffered_streams_total{path="/v1/chat/completions"}`), "three of four turns, and four turns twice")
		assert.Equal(t, "3", metricValue(page, `bidikv_buffered_streams_total{path="/v1/completions"}`))
	})

	t.Run("two identical runs", func(t *testing.T) {
		rep, out := runClients(t, node, px.url, "--api-key", "sk-clients")
		require.Zero(t, rep.Failed, out)
		runs := map[int]int{}
		for _, r := range rep.Rows {
			runs[r.Run]++
		}
		assert.Len(t, runs, 2, out)
	})
}
