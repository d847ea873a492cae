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
	kvOut, _ := completeIDs(t, url, ids, 1, kv)
	return kvOut
}

// completeIDs posts a /v1/completions request with the prompt ids and
// max_tokens (ignore_eos, so exactly that many are generated) and returns
// the answer's kv_transfer_params and generated token ids.
func completeIDs(t *testing.T, url string, ids []int, maxTokens int, kv any) (json.RawMessage, []int) {
	t.Helper()
	m := map[string]any{"model": "sim-model", "prompt": ids, "max_tokens": maxTokens, "ignore_eos": true, "return_token_ids": true}
	if kv != nil {
		m["kv_transfer_params"] = kv
	}
	raw, _ := json.Marshal(m)
	resp, err := http.Post(url+"/v1/completions", "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var b struct {
		KV      json.RawMessage `json:"kv_transfer_params"`
		Choices []struct {
			TokenIDs []int `json:"token_ids"`
		} `json:"choices"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&b))
	require.Len(t, b.Choices, 1)
	return b.KV, b.Choices[0].TokenIDs
}

// calibrationPoint is one published 1P1D result (internal/sim/cost.go): a
// turn of tokens prompt tokens whose previous turn had prev prompt tokens
// and a 48-token reply, the conversation shape of the fit.
type calibrationPoint struct {
	profile      string
	tokens, prev int
	off, on      float64 // TTFT, ms
	prefillOn    float64 // P's part of a hit: its pull of D's blocks and its prefill, ms
	transfer     float64 // P's pull of D's blocks, ms
	onTolerance  float64 // the allowed relative error of on
}

// The published points, with the previous prompt 1/growth of the turn's:
// qwen3-32b grows 1.2823× a turn (12 turns from 2k to 24k), glm-5-fp8
// 1.1451× (19 turns from 2k to 20k).
var calibrationPoints = []calibrationPoint{
	// TTFT on at 2k is below its own prefill on (122 < 128 ms); no model
	// in which D works after P can come near it (cost.go).
	{"qwen3-32b", 2000, 1560, 158, 122, 128, 30, 0.35},
	{"qwen3-32b", 24000, 18717, 778, 460, 414, 130, 0.10},
	{"glm-5-fp8", 2000, 1747, 500, 358, 316, 29, 0.10},
	{"glm-5-fp8", 20000, 17466, 2334, 702, 541, 110, 0.10},
}

// figures is what one turn cost, modelled by the engines.
type figures struct {
	ttft, prefillOn, transfer time.Duration
	pulled, computed, dRead   int
}

// runTurnPair runs a previous turn and then the turn of the point on a fresh
// 1P1D pair on a virtual clock, with reuse on (P pulls the history from D)
// or off (P recomputes everything), and reads the engines' records.
func runTurnPair(t *testing.T, pt calibrationPoint, reuse bool) figures {
	t.Helper()
	prof, ok := kvroutetest.LookupProfile(pt.profile)
	require.True(t, ok)
	reg, clk := kvroutetest.NewRegistry(), kvroutetest.NewVirtualClock(time.Unix(0, 0))
	common := []kvroutetest.Option{kvroutetest.WithRegistry(reg), kvroutetest.WithClock(clk),
		kvroutetest.WithProfile(prof), kvroutetest.WithNumBlocks(4096), kvroutetest.WithBidirectional(reuse)}
	p := kvroutetest.NewEngine(t, append(common, kvroutetest.WithPrefixCaching(false))...)
	d := kvroutetest.NewEngine(t, common...)

	prompt := make([]int, pt.prev)
	for i := range prompt {
		prompt[i] = 1000 + i%5000
	}
	pkv, _ := completeIDs(t, p.URL(), prompt, 1, miss)
	dkv, reply := completeIDs(t, d.URL(), prompt, 48, pkv)
	require.Len(t, reply, 48)
	next := append(append(prompt, reply...), make([]int, pt.tokens-pt.prev-len(reply))...)
	for i := pt.prev + len(reply); i < len(next); i++ {
		next[i] = 7000 + i%3000
	}
	kv := any(miss)
	if reuse {
		require.NotEmpty(t, dkv)
		kv = dkv
	}
	pkv, _ = completeIDs(t, p.URL(), next, 1, kv)
	completeIDs(t, d.URL(), next, 48, pkv)

	pr := p.Requests()
	dr := d.Requests()
	pre, dec := pr[len(pr)-1], dr[len(dr)-1]
	require.Equal(t, pt.tokens, pre.PromptTokens)
	return figures{
		ttft:      pre.Transfer + pre.Prefill + dec.Transfer + prof.Decode(1),
		prefillOn: pre.Transfer + pre.Prefill,
		transfer:  pre.Transfer,
		pulled:    pre.PulledTokens, computed: pre.ComputedTokens, dRead: dec.PulledTokens,
	}
}

// TestProfileCalibration runs each published point on the engines, as the
// fit in internal/sim/cost.go models it (P pulls the history and computes
// the suffix attending to all of it; D, holding the history, reads only the
// new blocks from P and decodes the first token), and checks the four
// published figures within 10%, but qwen3-32b's TTFT on at 2k (see
// calibrationPoints).
func TestProfileCalibration(t *testing.T) {
	within := func(t *testing.T, what string, want float64, got time.Duration, tol float64) {
		t.Helper()
		ms := float64(got) / float64(time.Millisecond)
		t.Logf("%-11s published %5.0f ms, modelled %7.1f ms (%+5.1f%%)", what, want, ms, 100*(ms/want-1))
		assert.InEpsilon(t, want, ms, tol, "%s: published %.0f ms, modelled %.1f ms (%+.1f%%)", what, want, ms, 100*(ms/want-1))
	}
	for _, pt := range calibrationPoints {
		t.Run(fmt.Sprintf("%s/%d", pt.profile, pt.tokens), func(t *testing.T) {
			off := runTurnPair(t, pt, false)
			on := runTurnPair(t, pt, true)
			hist := pt.prev + 47 // the previous prompt and reply, less the reply's last token
			assert.Zero(t, off.pulled, "reuse off: P pulls nothing")
			assert.Equal(t, pt.tokens, off.computed, "reuse off: P recomputes everything")
			assert.Equal(t, hist, on.pulled, "reuse on: P pulls the history D holds")
			assert.Equal(t, pt.tokens-hist, on.computed, "reuse on: P computes only the suffix")
			assert.Equal(t, pt.tokens-hist/16*16, on.dRead, "D reads only the blocks it lacks")
			assert.Equal(t, on.dRead, off.dRead, "D holds the history with reuse off too (prefix cache)")

			within(t, "TTFT off", pt.off, off.ttft, 0.10)
			within(t, "TTFT on", pt.on, on.ttft, pt.onTolerance)
			within(t, "prefill on", pt.prefillOn, on.prefillOn, 0.10)
			within(t, "KV transfer", pt.transfer, on.transfer, 0.10)
			if pt.onTolerance > 0.10 {
				assert.Greater(t, on.ttft, on.prefillOn, "TTFT on includes D's read and first token after P")
			}
		})
	}
	_, ok := kvroutetest.LookupProfile("llama")
	assert.False(t, ok)
}

// TestEngineAdvancesClock: an engine advances its virtual clock by the
// modelled prefill and decode, and D's read of n tokens costs Transfer(n).
func TestEngineAdvancesClock(t *testing.T) {
	prof, ok := kvroutetest.LookupProfile("qwen3-32b")
	require.True(t, ok)
	clk := kvroutetest.NewVirtualClock(time.Unix(0, 0))
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithProfile(prof), kvroutetest.WithClock(clk),
		kvroutetest.WithNumBlocks(2048), kvroutetest.WithPrefixCaching(false))
	require.Same(t, clk, c.Clock)

	t0 := clk.Now()
	kv := completion(t, c.Prefill[0].URL(), 3000, miss)
	rec := c.Prefill[0].Requests()[0]
	assert.Equal(t, rec.Prefill+rec.Decode, clk.Now().Sub(t0), "the engine advanced the virtual clock")
	assert.Equal(t, prof.Prefill(3000, 0), rec.Prefill)
	assert.Equal(t, prof.Decode(1), rec.Decode)

	completion(t, c.Decode[0].URL(), 3000, kv)
	drec := c.Decode[0].Requests()[0]
	assert.Equal(t, 3000, drec.PulledTokens)
	assert.Equal(t, prof.Transfer(3000), drec.Transfer)
}

func TestZeroProfileCostsNothing(t *testing.T) {
	clk := kvroutetest.NewVirtualClock(time.Unix(0, 0))
	e := kvroutetest.NewEngine(t, kvroutetest.WithClock(clk))
	completion(t, e.URL(), 100, nil)
	assert.Equal(t, time.Unix(0, 0), clk.Now())
	rec := e.Requests()[0]
	assert.Zero(t, rec.Prefill+rec.Transfer+rec.Decode)
}
