package main

import (
	"io"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

func TestParseFlags(t *testing.T) {
	o, err := parseFlags([]string{
		"--port", "8100", "--no-enable-prefix-caching", "--block-size", "32", "--profile", "glm-5-fp8",
		"--speed", "10", "--stream-handles", "--side-channel-host", "fd00::1", "--side-channel-port", "5601",
		"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_both","engine_id":"d-fixed","kv_load_failure_policy":"recompute","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_recompute_threshold":0,"decoder_kv_blocks_ttl":60,"kv_lease_duration":2.5}}`,
	}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "127.0.0.1", o.host)
	assert.Equal(t, 8100, o.port)
	assert.Equal(t, "fd00::1", o.sideHost)
	assert.Equal(t, 5601, o.sidePort)
	c := o.cfg
	assert.False(t, c.PrefixCaching)
	assert.Equal(t, 32, c.BlockSize)
	assert.Equal(t, "glm-5-fp8", c.Profile.Name)
	assert.Equal(t, 10.0, c.Speed)
	assert.True(t, c.StreamHandles)
	assert.True(t, c.Bidirectional)
	assert.False(t, c.NoKVConnector)
	assert.Zero(t, c.RecomputeThreshold)
	assert.Equal(t, time.Minute, c.DecoderBlocksTTL)
	assert.Equal(t, 2500*time.Millisecond, c.LeaseDuration)
	assert.Equal(t, sim.PolicyRecompute, c.KVLoadFailurePolicy)
	assert.Equal(t, "d-fixed", c.EngineID)
}

func TestParseFlagsDefaults(t *testing.T) {
	o, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.True(t, o.cfg.PrefixCaching)
	assert.Equal(t, 5600, o.sidePort)
	assert.Equal(t, sim.RenderEnabled, o.cfg.Render)
}

// vLLM's defaults for what --kv-transfer-config leaves out
// (vllm/config/kv_transfer.py, KVTransferConfig; nixl/base_scheduler.py,
// NixlBaseConnectorScheduler.__init__), and no connector at all without
// it (v1/core/sched/scheduler.py, Scheduler.__init__).
func TestParseFlagsKVTransferDefaults(t *testing.T) {
	o, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.True(t, o.cfg.NoKVConnector, "no --kv-transfer-config: no KV connector")
	assert.False(t, o.cfg.Bidirectional)

	o, err = parseFlags([]string{"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`}, io.Discard)
	require.NoError(t, err)
	c := o.cfg
	assert.False(t, c.NoKVConnector)
	assert.False(t, c.Bidirectional, "bidirectional_kv_xfer defaults to false")
	assert.Equal(t, 64, c.RecomputeThreshold)
	assert.Equal(t, 480*time.Second, c.DecoderBlocksTTL)
	assert.Equal(t, 30*time.Second, c.LeaseDuration)
	assert.Equal(t, sim.PolicyFail, c.KVLoadFailurePolicy)
	assert.Empty(t, c.EngineID, "a random id per start")

	o, err = parseFlags([]string{"--kv-transfer-config",
		`{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`}, io.Discard)
	require.NoError(t, err)
	assert.True(t, o.cfg.Bidirectional)
	assert.Equal(t, 64, o.cfg.RecomputeThreshold)

	// PR #55801 guards D's pulls too, with a default of 0 without
	// bidirectional transfer
	o, err = parseFlags([]string{"--decode-recompute", "--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`}, io.Discard)
	require.NoError(t, err)
	assert.Zero(t, o.cfg.RecomputeThreshold)

	// the connector's settings are read from kv_connector_extra_config
	// only, kv_load_failure_policy from the top level only
	o, err = parseFlags([]string{"--kv-transfer-config",
		`{"kv_connector":"NixlConnector","kv_role":"kv_both","bidirectional_kv_xfer":true,"kv_lease_duration":5,` +
			`"kv_connector_extra_config":{"kv_load_failure_policy":"recompute"}}`}, io.Discard)
	require.NoError(t, err)
	assert.False(t, o.cfg.Bidirectional, "ignored at the top level")
	assert.Equal(t, 30*time.Second, o.cfg.LeaseDuration)
	assert.Equal(t, sim.PolicyFail, o.cfg.KVLoadFailurePolicy)
	for _, key := range []string{"bidirectional_kv_xfer at the top level", "kv_lease_duration at the top level", "kv_load_failure_policy in kv_connector_extra_config"} {
		assert.Contains(t, strings.Join(o.warnings, "\n"), key)
	}

	for name, kvc := range map[string]string{
		"no connector":    `{"kv_role":"kv_both"}`,
		"other connector": `{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}`,
		"no role":         `{"kv_connector":"NixlConnector"}`,
		"unknown role":    `{"kv_connector":"NixlConnector","kv_role":"kv_prefill"}`,
	} {
		_, err := parseFlags([]string{"--kv-transfer-config", kvc}, io.Discard)
		assert.Error(t, err, name)
	}
}

func TestParseFlagsRenderAPI(t *testing.T) {
	tests := []struct{ arg, want string }{
		{"enabled", sim.RenderEnabled},
		{"disabled", sim.RenderDisabled},
		{"absent", sim.RenderAbsent},
	}
	for _, tt := range tests {
		t.Run(tt.arg, func(t *testing.T) {
			o, err := parseFlags([]string{"--render-api", tt.arg}, io.Discard)
			require.NoError(t, err)
			assert.Equal(t, tt.want, o.cfg.Render)
		})
	}
	o, err := parseFlags([]string{"--render-api", "sometimes"}, io.Discard)
	require.NoError(t, err, "validated when the engine starts")
	_, err = sim.New(o.cfg)
	assert.ErrorIs(t, err, sim.ErrInvalidConfig)
}

func TestParseFlagsModel(t *testing.T) {
	o, err := parseFlags([]string{"--port", "1", "Qwen/Qwen3-32B"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "Qwen/Qwen3-32B", o.cfg.Model)
}

func TestParseFlagsErrors(t *testing.T) {
	tests := map[string][]string{
		"bad json":        {"--kv-transfer-config", "{"},
		"unknown profile": {"--profile", "llama"},
		"two models":      {"a", "b"},
		"unknown flag":    {"--gpu-memory-utilization-typo", "1"},
	}
	for name, args := range tests {
		t.Run(name, func(t *testing.T) {
			_, err := parseFlags(args, io.Discard)
			assert.Error(t, err)
		})
	}
}

func TestParseFlagsTemplate(t *testing.T) {
	o, err := parseFlags([]string{"--reasoning", "--inline-reasoning", "--reasoning-field", "both", "--template", "llama3",
		"--chat-template-content-format", "openai", "--drift-rate", "0.25", "--kv-groups", "3",
		"--prefill-handle-on-length-only", "--decode-recompute"}, io.Discard)
	require.NoError(t, err)
	c := o.cfg
	assert.True(t, c.Reasoning)
	assert.True(t, c.InlineReasoning)
	assert.Equal(t, sim.ReasoningFieldBoth, c.ReasoningField)
	assert.Equal(t, sim.TemplateLlama3, c.Template)
	assert.Equal(t, sim.ContentFormatOpenAI, c.ContentFormat)
	assert.Equal(t, 0.25, c.DriftRate)
	assert.Equal(t, 3, c.KVGroups)
	assert.True(t, c.PrefillHandleOnLengthOnly)
	assert.True(t, c.DecodeRecompute)

	d, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.False(t, d.cfg.InlineReasoning)
	assert.Equal(t, sim.ReasoningFieldReasoning, d.cfg.ReasoningField)
	assert.Equal(t, sim.TemplateChatML, d.cfg.Template)
	assert.Equal(t, sim.ContentFormatString, d.cfg.ContentFormat)
}

func TestParseFlagsCapacity(t *testing.T) {
	o, err := parseFlags([]string{"--profile", "qwen3-32b"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, o.cfg.Profile.NumGPUBlocks(16), o.cfg.NumBlocks, "a node's capacity")
	assert.Equal(t, 232907, o.cfg.NumBlocks)

	o, err = parseFlags([]string{"--profile", "qwen3-32b", "--num-gpu-blocks-override", "1000", "--max-num-seqs", "8",
		"--sim-version", "0.9.2", "--no-tokenize", "--no-responses-kv-transfer", "--no-messages-kv-transfer",
		"--kv-usage-metric", "both"}, io.Discard)
	require.NoError(t, err)
	c := o.cfg
	assert.Equal(t, 999, c.NumBlocks, "num_gpu_blocks counts vLLM's null block")
	assert.Equal(t, 8, c.MaxNumSeqs)
	assert.Equal(t, "0.9.2", c.Version)
	assert.True(t, c.NoTokenize)
	assert.True(t, c.NoResponsesKV)
	assert.True(t, c.NoMessagesKV)
	assert.Equal(t, sim.UsageMetricBoth, c.UsageMetric)

	o, err = parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, sim.DefaultConfig().NumBlocks, o.cfg.NumBlocks)
	assert.Equal(t, 1024, o.cfg.MaxNumSeqs)
	assert.Equal(t, sim.DefaultVersion, o.cfg.Version)
	_, err = parseFlags([]string{"--num-gpu-blocks-override", "1"}, io.Discard)
	assert.Error(t, err)
}

// vllmsim takes the --kv-transfer-config vLLM takes: kv_role one of
// vLLM's, and required with a kv_connector (KVTransferConfig.__post_init__).
func TestParseFlagsKVRole(t *testing.T) {
	for _, role := range []string{"kv_producer", "kv_consumer", "kv_both"} {
		_, err := parseFlags([]string{"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"` + role + `"}`}, io.Discard)
		assert.NoError(t, err, role)
	}
	_, err := parseFlags([]string{"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_prefill"}`}, io.Discard)
	assert.ErrorContains(t, err, `--kv-transfer-config: Unsupported kv_role: kv_prefill.`)
	_, err = parseFlags([]string{"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`}, io.Discard)
	assert.ErrorContains(t, err, `Please specify kv_role when kv_connector is set`)
}

// A hybrid model, as vLLM runs one with full-attention and
// sliding-window layers: two KV groups, the second of larger blocks and a
// window. A group block size that is not a multiple of --block-size, or a
// window without a second group, is refused (vLLM multiplies a group's
// block size by its page ratio).
func TestParseFlagsHybrid(t *testing.T) {
	o, err := parseFlags([]string{"--block-size", "64", "--kv-groups", "2", "--kv-group-block-size", "128", "--sliding-window", "200"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 2, o.cfg.KVGroups)
	assert.Equal(t, 128, o.cfg.GroupBlockSize)
	assert.Equal(t, 200, o.cfg.SlidingWindow)
	for _, args := range [][]string{
		{"--block-size", "64", "--kv-groups", "2", "--kv-group-block-size", "96"},
		{"--sliding-window", "200"},
	} {
		o, err := parseFlags(args, io.Discard)
		require.NoError(t, err)
		_, err = sim.New(o.cfg)
		assert.ErrorIs(t, err, sim.ErrInvalidConfig, args)
	}
}
