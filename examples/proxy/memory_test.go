package main

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Issue 23, through the proxy: with a decode engine of little KV capacity
// the proxy reads the capacity from its /metrics, releases the holds over
// --decode-memory-budget with release requests, and /metrics shows the
// capacity, the budget, what is pinned (within the budget), the releases
// by reason and the learned pauses; every answer is a single engine's.
// With a negative budget nothing is released.
func TestDecodeMemoryBudgetFlag(t *testing.T) {
	for _, budget := range []string{"0.5", "-1"} {
		t.Run(budget, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithNumBlocks(64))
			d := cl.Decode[0].URL()
			p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", d, "--decode-memory-budget", budget)
			ask := func(b string) {
				t.Helper()
				status, _, body := p.do(t, http.MethodPost, "/v1/chat/completions", b, "Content-Type", "application/json")
				require.Equal(t, http.StatusOK, status, body)
				ref, err := kvroutetest.Reference("/v1/chat/completions", []byte(b))
				require.NoError(t, err)
				assert.Equal(t, ref.Text, chatAnswer(t, body), "differs from a single engine's")
			}
			for i := range 8 {
				system := reuseSystem
				if budget != "-1" {
					// Managed, the shared prompt is counted once, as D
					// stores it: conversations that share no block take
					// the holds over the budget. (Unmanaged, eight of
					// them would not fit D.)
					system = fmt.Sprintf("Conversation %d. %s", i, reuseSystem)
				}
				ask(plainChat(system, fmt.Sprintf("Conversation %d: list the failing tests.", i)))
				if i == 0 && budget != "-1" {
					// The engine's capacity is read in the background after
					// the first turn that considered it.
					for range 5000 {
						_, _, page := p.do(t, http.MethodGet, "/metrics", "")
						if metricValue(page, fmt.Sprintf(`bidikv_decode_kv_capacity_tokens{endpoint=%q}`, d)) == "1024" {
							break
						}
						time.Sleep(time.Millisecond)
					}
				}
			}
			// Released over the budget, or on a leg's arrival: the budget
			// bounds holds and live legs together.
			var page string
			releases := func() int {
				n := 0
				for _, reason := range []string{"budget", "room"} {
					v, _ := strconv.Atoi(metricValue(page, `bidikv_decode_releases_total{reason="`+reason+`"}`))
					n += v
				}
				return n
			}
			for range 5000 { // the releases run in the background
				_, _, page = p.do(t, http.MethodGet, "/metrics", "")
				if budget == "-1" || releases() > 0 {
					break
				}
				time.Sleep(time.Millisecond)
			}
			released := releases()
			pinned, _ := strconv.Atoi(metricValue(page, fmt.Sprintf(`bidikv_decode_kv_pinned_tokens{endpoint=%q}`, d)))
			assert.Equal(t, "0", metricValue(page, "bidikv_decode_release_failures_total"))
			if budget == "-1" {
				assert.Zero(t, released)
				assert.Zero(t, cl.Decode[0].Stats().NotifiedHolds)
				assert.Equal(t, "0", metricValue(page, fmt.Sprintf(`bidikv_decode_kv_budget_tokens{endpoint=%q}`, d)))
				return
			}
			assert.Equal(t, "1024", metricValue(page, fmt.Sprintf(`bidikv_decode_kv_capacity_tokens{endpoint=%q}`, d)))
			assert.Equal(t, "512", metricValue(page, fmt.Sprintf(`bidikv_decode_kv_budget_tokens{endpoint=%q}`, d)))
			assert.Positive(t, released)
			assert.LessOrEqual(t, pinned, 512, "within the budget")
			for _, sample := range []string{fmt.Sprintf(`bidikv_decode_kv_usage{endpoint=%q}`, d),
				fmt.Sprintf(`bidikv_decode_kv_unseen_tokens{endpoint=%q}`, d),
				fmt.Sprintf(`bidikv_decode_kv_held_handles_by_age{endpoint=%q,le="+Inf"}`, d), "bidikv_turn_return_probability"} {
				assert.NotEqual(t, "absent", metricValue(page, sample), sample) // metricValue's answer for a missing sample
			}
			assert.Zero(t, cl.Decode[0].Stats().WrongOutputs)
		})
	}
}

// The decode memory flags are checked, each error naming its flag.
func TestDecodeMemoryFlagErrors(t *testing.T) {
	for _, tc := range []struct{ args []string }{
		{[]string{"--decode-memory-budget", "1.5"}},
		{[]string{"--decode-memory-budget", "0"}},
		{[]string{"--decode-high-watermark", "2"}},
		{[]string{"--decode-memory-headroom", "1"}},
		{[]string{"--decode-memory-headroom", "0"}},
		{[]string{"--decode-memory-room-rate", "0"}},
		{[]string{"--decode-memory-room-rate", "NaN"}},
		{[]string{"--decode-kv-capacity", "-1"}},
		{[]string{"--decode-metrics-interval", "-1s"}},
		{[]string{"--decode-memory-releases", "0"}},
	} {
		_, err := parseCommand("bidikv-proxy", "", tc.args, noEnv, nil, nil)
		require.Error(t, err, "%v", tc.args)
		assert.ErrorIs(t, err, errUsage)
		assert.Contains(t, err.Error(), tc.args[0])
	}
}

// Through the proxy, every release of a handle it did not keep, and every
// decode leg that made no room, is counted by reason in /metrics: an
// answer of n = 2 choices (its hold released at once, reason n_gt_1) and a
// request over the engine's max_model_len (rejected by the engine with
// 400, no room made).
func TestDecodeMemoryOrphanMetrics(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithNumBlocks(64))
	d := cl.Decode[0]
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", d.URL())
	body := strings.Replace(plainChat(reuseSystem, "List the failing tests."), `"max_tokens":16`, `"max_tokens":16,"n":2`, 1)
	status, _, answer := p.do(t, http.MethodPost, "/v1/chat/completions", body, "Content-Type", "application/json")
	require.Equal(t, http.StatusOK, status, answer)
	ref, err := kvroutetest.Reference("/v1/chat/completions", []byte(body))
	require.NoError(t, err)
	assert.Equal(t, ref.Text, chatAnswer(t, answer), "differs from a single engine's")
	var page string
	for range 5000 { // the release and the engine's max_model_len come in the background
		_, _, page = p.do(t, http.MethodGet, "/metrics", "")
		if metricValue(page, `bidikv_decode_releases_total{reason="n_gt_1"}`) == "1" &&
			metricValue(page, fmt.Sprintf(`bidikv_decode_kv_capacity_tokens{endpoint=%q}`, d.URL())) == "1024" {
			break
		}
		time.Sleep(time.Millisecond)
	}
	assert.Equal(t, "1", metricValue(page, `bidikv_decode_releases_total{reason="n_gt_1"}`))
	assert.Equal(t, 1, d.Stats().NotifiedHolds, "D freed the hold at once")
	huge := strings.Replace(plainChat(reuseSystem, "Write everything."), `"max_tokens":16`, `"max_tokens":125000`, 1)
	status, _, answer = p.do(t, http.MethodPost, "/v1/chat/completions", huge, "Content-Type", "application/json")
	assert.Equal(t, http.StatusBadRequest, status, answer)
	_, _, page = p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "1", metricValue(page, `bidikv_decode_room_limited_total{reason="rejected"}`))
	for _, reason := range []string{"room", "refused", "store_error", "overwritten"} {
		assert.Equal(t, "0", metricValue(page, fmt.Sprintf(`bidikv_decode_releases_total{reason=%q}`, reason)), reason)
	}
	assert.Equal(t, "0", metricValue(page, "bidikv_decode_unreleasable_total"))
}
