package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// A decode engine whose /metrics carry no vllm:cache_config_info (vLLM
// with --disable-log-stats) leaves decode memory management off for it.
// That is never silent: at start-up the proxy logs it once with the fix,
// counts it (bidikv_decode_kv_capacity_unknown_total), /ready names it
// for the engine with the fix, and the doctor lists it as a gap whose fix
// is --decode-kv-capacity. With --decode-kv-capacity the management is on
// (the engine has a budget) and none of that is shown.
func TestUnknownCapacityNamedThroughProxy(t *testing.T) {
	for _, capacity := range []string{"", "100000"} {
		t.Run("decode-kv-capacity="+capacity, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
			du := noVLLMMetrics(t, cl.Decode[0])
			args := []string{"--prefill", cl.Prefill[0].URL(), "--decode", du}
			if capacity != "" {
				args = append(args, "--decode-kv-capacity", capacity)
			}
			p := startInProcess(t, nil, args...)
			decodeState := func() engineState {
				_, engines := readyEngines(t, p)
				for _, e := range engines {
					if e.Role == roleDecode {
						return e
					}
				}
				t.Fatal("no decode engine on /ready")
				return engineState{}
			}
			const warning = "KV capacity is unknown: decode memory management is off"
			if capacity == "" {
				// At start-up, before any turn.
				for i := 0; i < 500 && p.metric(t, "bidikv_decode_kv_capacity_unknown_total") != "1"; i++ {
					time.Sleep(10 * time.Millisecond)
				}
				assert.Equal(t, "1", p.metric(t, "bidikv_decode_kv_capacity_unknown_total"))
				st := decodeState()
				assert.Contains(t, st.NoCapacity, "vllm:cache_config_info")
				assert.Contains(t, st.NoCapacity, "--decode-kv-capacity", "/ready prints the fix")
				assert.Equal(t, 1, strings.Count(p.stderr.String(), warning), "%s", p.stderr.String())
				assert.Contains(t, p.stderr.String(), "--decode-kv-capacity")
			}
			for i := range 2 {
				c := newTenantConv("/v1/chat/completions", false)
				c.ask(fmt.Sprintf("Conversation %d: name the next file to read.", i))
				status, _, text := c.send(t, p.client, p.url, nil)
				require.Equal(t, http.StatusOK, status, text)
			}
			budget := metricValue(func() string { _, _, page := p.do(t, http.MethodGet, "/metrics", ""); return page }(),
				fmt.Sprintf(`bidikv_decode_kv_budget_tokens{endpoint=%q}`, du))
			if capacity == "" {
				assert.Equal(t, "0", budget, "management off for the engine")
				assert.Equal(t, "1", p.metric(t, "bidikv_decode_kv_capacity_unknown_total"))
				assert.Equal(t, 1, strings.Count(p.stderr.String(), warning), "logged once")
			} else {
				assert.NotEqual(t, "0", budget, "management on for the engine")
				assert.NotEmpty(t, budget)
				assert.Equal(t, "0", p.metric(t, "bidikv_decode_kv_capacity_unknown_total"))
				assert.Empty(t, decodeState().NoCapacity)
				assert.NotContains(t, p.stderr.String(), warning)
			}

			// The doctor, with the same flags.
			stdout := &syncBuffer{}
			_ = run(context.Background(), append([]string{"doctor", "--json"}, args...), noEnv, stdout, &syncBuffer{})
			var rep doctorJSON
			require.NoError(t, json.Unmarshal([]byte(stdout.String()), &rep), stdout.String())
			var gap string
			for _, g := range rep.Gaps {
				if strings.Contains(g.What, "KV capacity unknown") {
					gap = g.Severity + ": " + g.What + " fix: " + g.Fix
				}
			}
			if capacity == "" {
				assert.Contains(t, gap, "decode engine "+du)
				assert.Contains(t, gap, "decode memory management is off")
				assert.Contains(t, gap, "fix: --decode-kv-capacity")
			} else {
				assert.Empty(t, gap)
			}
		})
	}
}
