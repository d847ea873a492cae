package kvroutetest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func TestVirtualClockTimers(t *testing.T) {
	c := kvroutetest.NewVirtualClock(time.Unix(0, 0))
	var order []int
	var at []time.Time
	c.AfterFunc(2*time.Second, func() { order = append(order, 2); at = append(at, c.Now()) })
	c.AfterFunc(time.Second, func() { order = append(order, 1); at = append(at, c.Now()) })
	stop := c.AfterFunc(time.Second, func() { order = append(order, 9) })
	require.True(t, stop())
	assert.False(t, stop(), "stopped once")
	c.Advance(1500 * time.Millisecond)
	assert.Equal(t, []int{1}, order)
	require.NoError(t, c.Sleep(context.Background(), time.Second))
	assert.Equal(t, []int{1, 2}, order)
	assert.Equal(t, []time.Time{time.Unix(1, 0), time.Unix(2, 0)}, at, "each timer runs at its own time")
	assert.Equal(t, time.Unix(2, 500_000_000), c.Now())
}

func TestEventClock(t *testing.T) {
	c := kvroutetest.NewEventClock(time.Unix(0, 0))
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	var woke []time.Duration
	done := make(chan struct{})
	for _, d := range []time.Duration{3 * time.Second, time.Second} {
		c.Join()
		go func() {
			defer c.Leave()
			if c.Sleep(ctx, d) == nil {
				woke = append(woke, c.Now().Sub(time.Unix(0, 0)))
			}
			if d == time.Second {
				close(done)
			}
		}()
	}
	require.NoError(t, c.AwaitBlocked(ctx, 2))
	at, ok := c.Next()
	require.True(t, ok)
	assert.Equal(t, time.Unix(1, 0), at)
	assert.Equal(t, time.Unix(0, 0), c.Now(), "time moves only when a timer fires")
	require.NoError(t, c.Run(ctx))
	<-done
	assert.Equal(t, []time.Duration{time.Second, 3 * time.Second}, woke)
	assert.Equal(t, 2, c.Fired())
	assert.Zero(t, c.Blocked())

	// every participant blocked, nothing to wake them
	c.Join()
	c.Park()
	assert.ErrorIs(t, c.Run(ctx), kvroutetest.ErrStalled)
	c.Unpark()
	c.Leave()

	sctx, scancel := context.WithCancel(ctx)
	scancel()
	assert.ErrorIs(t, c.Sleep(sctx, time.Second), context.Canceled)
}

// The named profiles' KV capacity on one 8×H200 node at tensor parallel 8
// (internal/sim/capacity.go has the arithmetic).
func TestProfileCapacity(t *testing.T) {
	for _, tt := range []struct {
		name          string
		bytesPerToken int64
		tokens        int
		gib           float64
	}{
		{"qwen3-32b", 64 * 8 * 128 * 2 * 2, 3726520, 909.8},
		{"glm-5-fp8", 78 * (656 + 132) * 8, 594829, 272.4},
	} {
		t.Run(tt.name, func(t *testing.T) {
			p, ok := kvroutetest.LookupProfile(tt.name)
			require.True(t, ok)
			assert.Equal(t, tt.bytesPerToken, p.KVBytesPerToken)
			assert.Equal(t, tt.tokens, p.KVCapacityTokens)
			assert.Equal(t, tt.tokens/16, p.NumGPUBlocks(16))
			assert.InDelta(t, tt.gib, float64(p.KVCapacityTokens)*float64(p.KVBytesPerToken)/(1<<30), 0.05)
		})
	}
	// 100 agent sessions of 50k tokens (issue 23) do not fit on one
	// qwen3-32b decode node
	p, _ := kvroutetest.LookupProfile("qwen3-32b")
	assert.Greater(t, 100*50_000, p.KVCapacityTokens)
	assert.Zero(t, kvroutetest.Profile{}.NumGPUBlocks(16))
}

func TestCapabilityOptions(t *testing.T) {
	get := func(url string) (int, string) {
		resp, err := http.Get(url)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	e := kvroutetest.NewEngine(t)
	status, b := get(e.URL() + "/version")
	assert.Equal(t, http.StatusOK, status)
	assert.Equal(t, `{"version":"`+kvroutetest.DefaultVersion+`"}`, b)
	_, b = get(e.URL() + "/metrics")
	assert.Contains(t, b, "vllm:kv_cache_usage_perc{")
	assert.Contains(t, b, `num_gpu_blocks="8193"`)

	old := kvroutetest.NewEngine(t, kvroutetest.WithVersion(""), kvroutetest.WithTokenize(false),
		kvroutetest.WithUsageMetric(kvroutetest.UsageMetricLegacy), kvroutetest.WithNumBlocks(100),
		kvroutetest.WithBlockSize(32), kvroutetest.WithMaxNumSeqs(4), kvroutetest.WithResponsesKV(false),
		kvroutetest.WithMessagesKV(false))
	status, _ = get(old.URL() + "/version")
	assert.Equal(t, http.StatusNotFound, status)
	resp, err := http.Post(old.URL()+"/tokenize", "application/json", bytes.NewBufferString(`{"model":"sim-model","prompt":"x"}`))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
	_, b = get(old.URL() + "/metrics")
	assert.Contains(t, b, "vllm:gpu_cache_usage_perc{")
	assert.NotContains(t, b, "vllm:kv_cache_usage_perc")
	assert.Contains(t, b, `num_gpu_blocks="101"`)
	assert.Contains(t, b, `block_size="32"`)
	assert.Equal(t, 100, old.Stats().TotalBlocks)

	_, err = kvroutetest.StartEngine(kvroutetest.WithMaxNumSeqs(-1))
	assert.ErrorIs(t, err, kvroutetest.ErrInvalidConfig)
	_, err = kvroutetest.StartEngine(kvroutetest.WithUsageMetric("new"))
	assert.ErrorIs(t, err, kvroutetest.ErrInvalidConfig)
}

// fleetIDs is a token-id prompt of n tokens, distinct per seed.
func fleetIDs(seed, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = 1000 + (seed*7919+i*31)%20000
	}
	return out
}

// fleetPost sends a completions request with a token-id prompt and returns
// the handle and the generated ids.
func fleetPost(ctx context.Context, url, id string, prompt []int, maxTokens int, kv any) (json.RawMessage, []int, error) {
	m := map[string]any{"model": "sim-model", "prompt": prompt, "max_tokens": maxTokens, "ignore_eos": true,
		"return_token_ids": true, "kv_transfer_params": kv}
	raw, _ := json.Marshal(m)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/completions", bytes.NewReader(raw))
	if err != nil {
		return nil, nil, err
	}
	req.Header.Set("X-Request-Id", id)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return nil, nil, err
	}
	defer resp.Body.Close()
	var b struct {
		KV      json.RawMessage `json:"kv_transfer_params"`
		Choices []struct {
			TokenIDs []int `json:"token_ids"`
		} `json:"choices"`
	}
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(resp.Body)
		return nil, nil, fmt.Errorf("%s %s: status %d: %s", url, id, resp.StatusCode, msg)
	}
	if err := json.NewDecoder(resp.Body).Decode(&b); err != nil || len(b.Choices) != 1 {
		return nil, nil, fmt.Errorf("%s: bad answer: %v", id, err)
	}
	return b.KV, b.Choices[0].TokenIDs, nil
}

// fleetFigures is what a fleet run measured, from the engines' records.
type fleetFigures struct {
	turns, queued, preemptions, wrong int
	firstTokens                       []time.Duration // per D request, by X-Request-Id
	lastAnswer                        time.Time
}

// runFleet runs sessions agent sessions of turns turns each, 1P1D by hand
// (P with the miss handle or the previous D handle, then D), with
// heavy-tailed think times, on an event clock and a decode engine of
// dBlocks blocks.
func runFleet(t *testing.T, sessions, turns, dBlocks int) fleetFigures {
	t.Helper()
	prof, ok := kvroutetest.LookupProfile("qwen3-32b")
	require.True(t, ok)
	clk := kvroutetest.NewEventClock(time.Unix(1_700_000_000, 0))
	reg := kvroutetest.NewRegistry()
	// Under pressure P's queue fills too (its blocks wait for D's reads),
	// and a handle can near its expiry while its P request waits: P then
	// declines the read and, with this policy, computes the prompt.
	p := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithClock(clk),
		kvroutetest.WithProfile(prof), kvroutetest.WithPrefixCaching(false),
		kvroutetest.WithKVLoadFailurePolicy("recompute"))
	d := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithClock(clk),
		kvroutetest.WithProfile(prof), kvroutetest.WithNumBlocks(dBlocks))

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var failed atomic.Value
	for s := range sessions {
		clk.Join()
		go func() {
			defer clk.Leave()
			rng := rand.New(rand.NewPCG(uint64(s), 7))
			if clk.Sleep(ctx, time.Duration(rng.IntN(20_000))*time.Millisecond) != nil {
				return
			}
			prompt := fleetIDs(s, 500+rng.IntN(1500))
			var dkv json.RawMessage
			var got time.Time
			for turn := range turns {
				kv := any(miss)
				if dkv != nil && clk.Now().Sub(got) < 450*time.Second { // as the reference proxy keeps them

					var h map[string]any
					_ = json.Unmarshal(dkv, &h)
					h["do_remote_decode"], h["do_remote_prefill"] = true, false
					kv = h
				}
				id := fmt.Sprintf("s%03d-t%d", s, turn)
				pkv, _, err := fleetPost(ctx, p.URL(), id, prompt, 1, kv)
				if err == nil && pkv == nil {
					err = fmt.Errorf("%s: no P handle", id)
				}
				var reply []int
				if err == nil {
					dkv, reply, err = fleetPost(ctx, d.URL(), id, prompt, 16+rng.IntN(48), pkv)
				}
				if err != nil {
					failed.CompareAndSwap(nil, err)
					return
				}
				got = clk.Now()
				// a tool call comes back in seconds, a person in minutes
				pause := time.Duration(2+rng.IntN(10)) * time.Second
				if rng.IntN(4) == 0 {
					pause = time.Duration(60+rng.IntN(600)) * time.Second
				}
				if clk.Sleep(ctx, pause) != nil {
					return
				}
				prompt = append(append(prompt, reply...), fleetIDs(s*100+turn, 200+rng.IntN(800))...)
			}
		}()
	}
	require.NoError(t, clk.Run(ctx))
	if err, _ := failed.Load().(error); err != nil {
		t.Fatalf("%v\nP %+v\nD %+v", err, p.Stats(), d.Stats())
	}
	var f fleetFigures
	recs := d.Requests()
	slices.SortFunc(recs, func(a, b kvroutetest.RequestRecord) int {
		switch {
		case a.RequestID < b.RequestID:
			return -1
		case a.RequestID > b.RequestID:
			return 1
		}
		return 0
	})
	for _, r := range recs {
		f.turns++
		f.firstTokens = append(f.firstTokens, r.FirstToken)
		if r.Queued > 0 {
			f.queued++
		}
		f.preemptions += r.Preemptions
		assert.GreaterOrEqual(t, r.FirstToken, r.Transfer+r.Prefill, r.RequestID)
	}
	f.wrong = d.Stats().WrongOutputs
	f.lastAnswer = clk.Now()
	return f
}

// A fleet of agent sessions on an event clock: the decode engine runs out
// of blocks (holds pile up for the TTL), requests wait and are preempted
// in modelled time, every answer stays right, and a run is repeatable.
func TestFleetOnEventClock(t *testing.T) {
	if testing.Short() {
		t.Skip("fleet run")
	}
	a := runFleet(t, 24, 4, 1200)
	assert.Equal(t, 24*4, a.turns)
	assert.Zero(t, a.wrong)
	assert.Positive(t, a.queued, "requests waited for blocks")
	t.Logf("fleet: %d turns, %d queued, %d preemptions, done after %s", a.turns, a.queued, a.preemptions,
		a.lastAnswer.Sub(time.Unix(1_700_000_000, 0)))
	b := runFleet(t, 24, 4, 1200)
	assert.Equal(t, a, b, "the same run twice")
}
