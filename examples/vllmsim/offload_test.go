package main

import (
	"io"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// tierKV is a MultiConnector(NixlConnector, OffloadingConnector)
// --kv-transfer-config as llm-d's P2P guide deploys it, with offload
// settings spliced in.
func tierKV(offload string) string {
	return `{"kv_connector":"MultiConnector","kv_role":"kv_both","engine_id":"e-1","kv_load_failure_policy":"recompute",` +
		`"kv_connector_extra_config":{"connectors":[` +
		`{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_recompute_threshold":32}},` +
		`{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":` + offload + `}]}}`
}

// The OffloadingConnector child's settings as build_offloading_config
// reads them: capacity from cpu_bytes_to_use over a chunk's bytes (or
// num_cpu_blocks), the chunk from block_size (a multiple of the GPU
// block) or blocks_per_chunk, offload_prompt_only default true, a p2p
// secondary tier under TieringOffloadingSpec; the NIXL child as a plain
// NIXL config, engine_id and kv_load_failure_policy from the top level.
func TestParseMultiConnector(t *testing.T) {
	o, err := parseFlags([]string{"--profile", "qwen3-32b", "--kv-transfer-config", tierKV(
		`{"spec_name":"TieringOffloadingSpec","cpu_bytes_to_use":2147483648,"block_size":64,"offload_prompt_only":false,"secondary_tiers":[{"type":"p2p","port":7777}]}`)}, io.Discard)
	require.NoError(t, err)
	c := o.cfg
	assert.True(t, c.Bidirectional)
	assert.Equal(t, 32, c.RecomputeThreshold)
	assert.Equal(t, "e-1", c.EngineID)
	assert.Equal(t, sim.PolicyRecompute, c.KVLoadFailurePolicy)
	assert.Equal(t, sim.CPUTier{Chunks: int(2147483648 / (c.Profile.KVBytesPerToken * 64)), BlocksPerChunk: 4,
		OffloadGenerated: true, HashAlgo: sim.HashSHA256, P2P: true, P2PPort: 7777}, c.CPUTier)

	o, err = parseFlags([]string{"--kv-transfer-config", tierKV(`{"num_cpu_blocks":100}`)}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, sim.CPUTier{Chunks: 100, BlocksPerChunk: 1, HashAlgo: sim.HashSHA256}, o.cfg.CPUTier, "prompt only, no peer tier")

	for name, bad := range map[string]string{
		"bytes without a profile": `{"cpu_bytes_to_use":1000000}`,
		"no capacity":             `{}`,
		"chunk not a multiple":    `{"num_cpu_blocks":8,"block_size":24}`,
		"both chunk keys":         `{"num_cpu_blocks":8,"block_size":32,"blocks_per_chunk":2}`,
		"tiers without tiering":   `{"num_cpu_blocks":8,"secondary_tiers":[{"type":"p2p"}]}`,
		"arc":                     `{"num_cpu_blocks":8,"eviction_policy":"arc"}`,
	} {
		_, err := parseFlags([]string{"--kv-transfer-config", tierKV(bad)}, io.Discard)
		assert.Error(t, err, name)
	}
	_, err = parseFlags([]string{"--kv-transfer-config", `{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":{"connectors":[{"kv_connector":"OffloadingConnector","kv_role":"kv_both"},{"kv_connector":"NixlConnector","kv_role":"kv_both"}]}}`}, io.Discard)
	assert.ErrorContains(t, err, "NIXL first")
}

// Two vllmsim processes: the second pulls the prompt's chunks from the
// first's CPU tier over the peer tier's HTTP stand-in, and answers as a
// single engine does.
func TestPeerPullAcrossProcesses(t *testing.T) {
	cfg := tierKV(`{"spec_name":"TieringOffloadingSpec","num_cpu_blocks":512,"offload_prompt_only":false,"secondary_tiers":[{"type":"p2p","port":0}]}`)
	a := spawn(t, "--kv-transfer-config", cfg, "--profile", "qwen3-32b")
	b := spawn(t, "--kv-transfer-config", cfg, "--profile", "qwen3-32b")
	m := regexp.MustCompile(` p2p (\S+)`).FindStringSubmatch(a.line)
	require.NotNil(t, m, a.line)
	host, portText, err := net.SplitHostPort(m[1])
	require.NoError(t, err)
	port, err := strconv.Atoi(portText)
	require.NoError(t, err)

	body := map[string]any{"model": "sim-model", "messages": []any{map[string]any{"role": "user",
		"content": "tell me about the sea and the ships on it, the harbors, the tides, the winds and the gulls"}}}
	text, _ := call(t, a.url, body)
	pull := map[string]any{}
	for k, v := range body {
		pull[k] = v
	}
	pull["kv_transfer_params"] = map[string]any{"remote_kv_source": map[string]any{"kv_request_id": "x-1", "remote_host": host, "remote_port": port}}
	got, _ := call(t, b.url, pull)
	assert.Equal(t, text, got)

	resp, err := http.Get(b.url + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	page, _ := io.ReadAll(resp.Body)
	loaded := regexp.MustCompile(`vllm:kv_offload_load_bytes_total\{[^}]*\} (\S+)`).FindSubmatch(page)
	require.NotNil(t, loaded, string(page))
	assert.NotEqual(t, "0.0", string(loaded[1]), "b loaded chunks pulled from a")
}
