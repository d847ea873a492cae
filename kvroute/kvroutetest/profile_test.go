package kvroutetest_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// completion posts a /v1/completions request with a prompt of exactly n
// token ids.
func completion(t *testing.T, url string, n int, kv any) json.RawMessage {
	t.Helper()
	ids := make([]int, n)
	for i := range ids {
		ids[i] = 1000 + i%5000
	}
	m := map[string]any{"model": "sim-model", "prompt": ids, "max_tokens": 1}
	if kv != nil {
		m["kv_transfer_params"] = kv
	}
	raw, _ := json.Marshal(m)
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var b struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&b))
	return b.KV
}

// The profiles reproduce the published calibration points within 5%: the
// recompute TTFT as modelled prefill, and the KV transfer time, both read off
// a virtual clock that the engines advance by their modelled durations.
func TestProfileCalibration(t *testing.T) {
	tests := []struct {
		profile  string
		tokens   int
		prefill  time.Duration
		transfer time.Duration
	}{
		{"qwen3-32b", 2000, 158 * time.Millisecond, 30 * time.Millisecond},
		{"qwen3-32b", 24000, 778 * time.Millisecond, 130 * time.Millisecond},
		{"glm-5-fp8", 2000, 500 * time.Millisecond, 29 * time.Millisecond},
		{"glm-5-fp8", 20000, 2334 * time.Millisecond, 110 * time.Millisecond},
	}
	within := func(t *testing.T, want, got time.Duration) {
		t.Helper()
		assert.InEpsilon(t, want.Seconds(), got.Seconds(), 0.05, "want %v, got %v", want, got)
	}
	for _, tt := range tests {
		t.Run(fmt.Sprintf("%s/%d", tt.profile, tt.tokens), func(t *testing.T) {
			prof, ok := kvroutetest.LookupProfile(tt.profile)
			require.True(t, ok)
			clk := kvroutetest.NewVirtualClock(time.Unix(0, 0))
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithProfile(prof), kvroutetest.WithClock(clk),
				kvroutetest.WithNumBlocks(2048), kvroutetest.WithPrefixCaching(false))
			require.Same(t, clk, c.Clock)

			t0 := clk.Now()
			kv := completion(t, c.Prefill[0].URL(), tt.tokens, miss)
			elapsed := clk.Now().Sub(t0)
			rec := c.Prefill[0].Requests()[0]
			within(t, tt.prefill, rec.Prefill)
			assert.Equal(t, rec.Prefill+rec.Decode, elapsed, "the engine advanced the virtual clock")
			assert.Equal(t, prof.Decode(1), rec.Decode)

			completion(t, c.Decode[0].URL(), tt.tokens, kv)
			drec := c.Decode[0].Requests()[0]
			assert.Equal(t, tt.tokens, drec.PulledTokens)
			within(t, tt.transfer, drec.Transfer)
		})
	}
	_, ok := kvroutetest.LookupProfile("llama")
	assert.False(t, ok)
}

func TestZeroProfileCostsNothing(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(0, 0))
	e := kvroutetest.NewEngine(t, kvroutetest.WithClock(clk))
	completion(t, e.URL(), 100, nil)
	assert.Equal(t, time.Unix(0, 0), clk.Now())
	rec := e.Requests()[0]
	assert.Zero(t, rec.Prefill+rec.Transfer+rec.Decode)
}
