package main

import (
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// tierSystem is a system prompt of about 3,600 tokens: long enough that
// pulling it from a CPU tier beats computing it (the cost model's
// threshold.Rates.PeerSaves).
var tierSystem = strings.Repeat(reuseSystem+" ", 50)

// Through the proxy's flags (--cpu-tier-tokens, --cpu-tier-peers), a
// conversation whose decode hold the budget released (a tiny
// --decode-memory-budget) is served from the decode engine's CPU tier: the
// next turn's prefill leg carries remote_kv_source naming the decode
// engine's peer tier, the prefill engine loads the history from it, the
// answer is a single engine's, and /metrics counts the pull.
func TestCPUTierFlagsServe(t *testing.T) {
	reg := kvroutetest.NewRegistry()
	common := []kvroutetest.Option{kvroutetest.WithRegistry(reg), kvroutetest.WithStreamHandles(true)}
	// P's GPU and CPU tier hold about one conversation: the second one
	// evicts the first, whose history then comes from D's tier.
	pe := kvroutetest.NewEngine(t, append(common, kvroutetest.WithNumBlocks(300),
		kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: 300, OffloadGenerated: true, P2P: true}))...)
	de := kvroutetest.NewEngine(t, append(common, kvroutetest.WithNumBlocks(1024),
		kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: 4096, OffloadGenerated: true, P2P: true, P2PPort: 5799}))...)
	host, port, ok := de.RankP2PChannel(0)
	require.True(t, ok)
	d := de.URL()
	// D's peer tier is not at --cpu-tier-port (5710) on its URL's host:
	// --cpu-tier-peers names it. Its entry names the decode engine as
	// --decode does not (a trailing slash): the proxy normalizes both alike.
	p := startInProcess(t, nil, "--prefill", pe.URL(), "--decode", d, "--decode-memory-budget", "0.1",
		"--cpu-tier-tokens", "65536", "--cpu-tier-peers", d+"/="+net.JoinHostPort(host, strconv.Itoa(port)))

	convs := make([][]map[string]string, 2)
	ask := func(i int, user, id string) {
		t.Helper()
		if convs[i] == nil {
			convs[i] = []map[string]string{{"role": "system", "content": fmt.Sprintf("Conversation %d. %s", i, tierSystem)}}
		}
		convs[i] = append(convs[i], map[string]string{"role": "user", "content": user})
		b, _ := json.Marshal(map[string]any{"model": "sim-model", "max_tokens": 64, "messages": convs[i]})
		status, _, body := p.do(t, http.MethodPost, "/v1/chat/completions", string(b), "Content-Type", "application/json", "X-Request-Id", id)
		require.Equal(t, http.StatusOK, status, body)
		ref, err := kvroutetest.Reference("/v1/chat/completions", b)
		require.NoError(t, err)
		answer := chatAnswer(t, body)
		require.Equal(t, ref.Text, answer, "%s differs from a single engine's", id)
		convs[i] = append(convs[i], map[string]string{"role": "assistant", "content": answer})
	}
	var page string
	waitFor := func(what string, done func() bool) {
		t.Helper()
		for range 5000 { // capacity reads and releases run in the background
			_, _, page = p.do(t, http.MethodGet, "/metrics", "")
			if done() {
				return
			}
			time.Sleep(time.Millisecond)
		}
		require.FailNow(t, "timed out waiting for "+what, page)
	}
	ask(0, "Conversation 0: list the failing tests.", "c0-t1")
	waitFor("the decode engine's capacity", func() bool {
		return metricValue(page, fmt.Sprintf(`bidikv_decode_kv_capacity_tokens{endpoint=%q}`, d)) == "16384"
	})
	ask(1, "Conversation 1: list the failing tests.", "c1-t1")
	// Each conversation alone is over the budget (1,638 tokens): both
	// holds are released, their KV left in D's CPU tier.
	waitFor("the holds' release", func() bool {
		return metricValue(page, fmt.Sprintf(`bidikv_decode_kv_pinned_tokens{endpoint=%q}`, d)) == "0" &&
			metricValue(page, `bidikv_decode_releases_total{reason="budget"}`) != "0"
	})
	require.Equal(t, "0", metricValue(page, "bidikv_cpu_tier_pulls_total"))

	ask(0, "Now fix the first failing test.", "c0-t2")
	var prefill []kvroutetest.RequestRecord
	for _, r := range pe.Requests() {
		if r.Role == "prefill" && strings.Contains(r.RequestID, "c0-t2") {
			prefill = append(prefill, r)
		}
	}
	require.Len(t, prefill, 1, "the turn's prefill leg")
	pr := prefill[0]
	var sent struct {
		Params struct {
			Source *struct {
				Host string `json:"remote_host"`
				Port int    `json:"remote_port"`
			} `json:"remote_kv_source"`
		} `json:"kv_transfer_params"`
	}
	require.NoError(t, json.Unmarshal(pr.Body, &sent))
	require.NotNil(t, sent.Params.Source, "the prefill leg carries remote_kv_source")
	assert.Equal(t, host, sent.Params.Source.Host, "--cpu-tier-peers' host")
	assert.Equal(t, port, sent.Params.Source.Port, "--cpu-tier-peers' port")
	assert.Positive(t, pr.PeerTokens, "the history came from the decode engine's tier")
	assert.Equal(t, pr.PromptTokens, pr.CachedTokens+pr.TierTokens+pr.ComputedTokens)
	t.Logf("prompt %d cached %d tier %d peer %d computed %d", pr.PromptTokens, pr.CachedTokens, pr.TierTokens, pr.PeerTokens, pr.ComputedTokens)
	_, _, page = p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "1", metricValue(page, "bidikv_cpu_tier_pulls_total"))
	assert.Equal(t, "0", metricValue(page, "bidikv_cpu_tier_skipped_total"))
	assert.Equal(t, "0", metricValue(page, "bidikv_cpu_tier_short_total"))
	assert.Equal(t, "0", metricValue(page, "bidikv_cpu_tier_local_short_total"))
	assert.NotEqual(t, "absent", metricValue(page, `bidikv_turn_counts_total{field="peer_tokens"}`), "the turn record's peer_tokens")
	for _, e := range []*kvroutetest.Engine{pe, de} {
		assert.Zero(t, e.Stats().WrongOutputs)
	}
}

// The CPU tier flags are checked, each error naming its flag; the doctor
// reads --cpu-tier-tokens and --cpu-tier-port as the router does.
func TestCPUTierFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--cpu-tier-tokens", "-1"}, "is negative"},
		{[]string{"--cpu-tier-tokens", "1000", "--decode-memory-budget", "-1"}, "needs the decode memory management"},
		{[]string{"--cpu-tier-port", "0"}, "not a port"},
		{[]string{"--cpu-tier-port", "70000"}, "not a port"},
		{[]string{"--cpu-tier-peers", "http://d:8200"}, "want DECODE_URL=HOST:PORT"},
		{[]string{"--cpu-tier-peers", "http://d:8200=d"}, "want DECODE_URL=HOST:PORT"},
		{[]string{"--cpu-tier-peers", "http://d:8200=d:0"}, "1 to 65535"},
		{[]string{"--cpu-tier-peers", "http://d:8200=:5710"}, "want DECODE_URL=HOST:PORT"},
		{[]string{"--cpu-tier-peers", "ftp://d:8200=d:5710"}, "the decode URL"},
	} {
		_, err := parseCommand("bidikv-proxy", "", tc.args, noEnv, nil, nil)
		require.Error(t, err, "%v", tc.args)
		assert.ErrorIs(t, err, errUsage)
		assert.Contains(t, err.Error(), tc.args[0], "%v", tc.args)
		assert.Contains(t, err.Error(), tc.want, "%v", tc.args)
	}
	c, err := parseCommand("bidikv-proxy", "", []string{"--decode", "d1:8200", "--cpu-tier-tokens", "4096", "--cpu-tier-port", "5800",
		"--cpu-tier-peers", "d1:8200/=10.0.0.7:5711, http://d2:8200=10.0.0.8:5710", "--cpu-tier-prompt-only"}, noEnv, nil, nil)
	require.NoError(t, err)
	m := c.decodeMemory()
	assert.Equal(t, 4096, m.CPUTierTokens)
	assert.Equal(t, 5800, m.CPUTierPort)
	assert.True(t, m.CPUTierPromptOnly)
	assert.Equal(t, map[string]string{"http://d1:8200": "10.0.0.7:5711", "http://d2:8200": "10.0.0.8:5710"}, m.CPUTierPeers)
	require.Len(t, c.warnings, 1)
	assert.Contains(t, c.warnings[0], "--cpu-tier-peers names http://d2:8200, which is no decode engine")
}
