package main

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// doctor --probe against vllmsim processes started as vLLM would be: the
// simulator keeps vLLM's defaults for what --kv-transfer-config leaves
// out, so a misconfigured engine shows as misconfigured. Without
// bidirectional_kv_xfer (vLLM's default: false, nixl/base_scheduler.py)
// D answers without a handle; without --kv-transfer-config (no connector)
// P does too.
func TestDoctorProbeVLLMSimDefaults(t *testing.T) {
	cases := []struct {
		name string
		kv   []string // vllmsim's --kv-transfer-config arguments
		fail bool
		gap  string
	}{
		{name: "bidirectional_kv_xfer on", kv: []string{"--kv-transfer-config", kvConfig}},
		{name: "no bidirectional_kv_xfer", kv: []string{"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`},
			fail: true, gap: "learned: the decode engine answered a request carrying P's handle without one"},
		{name: "bidirectional_kv_xfer at the top level (vLLM ignores it)",
			kv:   []string{"--kv-transfer-config", `{"kv_connector":"NixlConnector","kv_role":"kv_both","bidirectional_kv_xfer":true}`},
			fail: true, gap: "learned: the decode engine answered a request carrying P's handle without one"},
		{name: "no --kv-transfer-config", fail: true, gap: "learned: the prefill engine answered without a handle"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			args := append([]string{"--port", "0", "--side-channel-port", "0"}, tc.kv...)
			p := start(t, "vllmsim", simReady, args...)
			d := start(t, "vllmsim", simReady, args...)
			stdout, stderr := &syncBuffer{}, &syncBuffer{}
			err := run(context.Background(), []string{"doctor", "--json", "--probe", "--prefill", p.url, "--decode", d.url}, noEnv, stdout, stderr)
			var out doctorJSON
			require.NoError(t, json.Unmarshal([]byte(stdout.String()), &out), "%s\n%s", stdout, stderr)
			if !tc.fail {
				assert.NoError(t, err, stdout.String())
				assert.True(t, out.Works, stdout.String())
				return
			}
			assert.True(t, errors.Is(err, errNoReuse), "%v\n%s", err, stdout)
			assert.False(t, out.Works, "reuse does not work on such engines")
			var gaps strings.Builder
			for _, g := range out.Gaps {
				gaps.WriteString(g.What + "\n  fix: " + g.Fix + "\n")
			}
			assert.Contains(t, gaps.String(), tc.gap)
			assert.Contains(t, gaps.String(), `"kv_connector_extra_config":{"bidirectional_kv_xfer":true}`, "the fix")
			for _, pr := range out.Probe {
				assert.Zero(t, pr.Reused, "%s: no turn reused", pr.API)
			}
		})
	}
}
