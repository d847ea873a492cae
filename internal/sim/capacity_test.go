package sim_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The engines' KV capacity against vLLM's v1 scheduler
// (vllm/v1/core/sched/scheduler.py), KV cache manager and block pool, and
// the NIXL pull connector (nixl/pull_scheduler.py, pull_worker.py). Each
// test names the function it mirrors.

// ms is a profile in which computing a token costs a millisecond and a
// decode step 10 ms, so that modelled times can be read off.
var ms = sim.Profile{PrefillPerToken: time.Millisecond, InterTokenLatency: 10 * time.Millisecond}

// idPrompt is a token-id prompt of n tokens, distinct per seed.
func idPrompt(seed, n int) []int {
	out := make([]int, n)
	for i := range out {
		out[i] = 1000 + (seed*7919+i*31)%20000
	}
	return out
}

// ids is a completions body with a token-id prompt that generates exactly
// maxTokens tokens.
func ids(prompt []int, maxTokens int, kv any) map[string]any {
	m := map[string]any{"model": "sim-model", "prompt": prompt, "max_tokens": maxTokens, "ignore_eos": true}
	if kv != nil {
		m["kv_transfer_params"] = kv
	}
	return m
}

// fetch is post without a *testing.T, for any goroutine.
func fetch(ctx context.Context, url, path string, body any) result {
	return fetchID(ctx, url, path, "", body)
}

// fetchID is fetch with an X-Request-Id.
func fetchID(ctx context.Context, url, path, id string, body any) result {
	raw, _ := json.Marshal(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+path, bytes.NewReader(raw))
	if err != nil {
		return result{Status: -1}
	}
	if id != "" {
		req.Header.Set("X-Request-Id", id)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return result{Status: -1}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	res := result{Status: resp.StatusCode, Body: b}
	var parsed struct {
		Choices []struct {
			Text     string `json:"text"`
			TokenIDs []int  `json:"token_ids"`
		} `json:"choices"`
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	if resp.StatusCode == http.StatusOK && json.Unmarshal(b, &parsed) == nil && len(parsed.Choices) > 0 {
		res.Text, res.TokenIDs = parsed.Choices[0].Text, parsed.Choices[0].TokenIDs
		if string(parsed.KV) != "null" {
			res.KV = parsed.KV
		}
	}
	return res
}

// async sends body from a goroutine that is a participant of clk until
// its answer comes.
func async(ctx context.Context, clk *kvroutetest.EventClock, url string, body any) <-chan result {
	clk.Join()
	ch := make(chan result, 1)
	go func() {
		defer clk.Leave()
		ch <- fetch(ctx, url, sim.PathCompletions, body)
	}()
	return ch
}

// settle waits until n goroutines are blocked on clk.
func settle(t *testing.T, clk *kvroutetest.EventClock, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := clk.AwaitBlocked(ctx, n); err != nil {
		buf := make([]byte, 1<<20)
		t.Fatalf("settle: %v\n%s", err, buf[:runtime.Stack(buf, true)])
	}
}

// run drives clk until every participant is done.
func run(t *testing.T, clk *kvroutetest.EventClock, engines ...*node) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	if err := clk.Run(ctx); err != nil {
		for _, e := range engines {
			t.Logf("%+v\n%s", e.Stats(), e.DebugQueues())
		}
		t.Fatalf("run: %v", err)
	}
}

func newEventClock() *kvroutetest.EventClock {
	return kvroutetest.NewEventClock(time.Unix(1_700_000_000, 0))
}

// recordOf returns the record of the request whose prompt starts with
// first (token-id prompts are distinct per seed).
func recordOf(t *testing.T, n *node, prompt []int) sim.Record {
	t.Helper()
	want, _ := json.Marshal(prompt)
	for _, r := range n.Records() {
		if bytes.Contains(r.Body, want) {
			return r
		}
	}
	t.Fatalf("no record for the prompt")
	return sim.Record{}
}

// hold makes D hold a conversation's blocks: a P leg with the miss handle,
// then D's leg generating gen tokens; it returns D's handle.
func hold(t *testing.T, p, d *node, prompt []int, gen int) json.RawMessage {
	t.Helper()
	rp := post(t, p.url, sim.PathCompletions, ids(prompt, 1, missHandle()))
	require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
	require.NotNil(t, rp.KV)
	rd := post(t, d.url, sim.PathCompletions, ids(prompt, gen, json.RawMessage(rp.KV)))
	require.Equal(t, http.StatusOK, rd.Status, string(rd.Body))
	require.NotNil(t, rd.KV)
	return rd.KV
}

// Held blocks are pinned: counted as used and never evicted, so a request
// that does not fit waits for the TTL, and one behind it waits too even
// though it would fit (Scheduler.schedule stops at the first waiting
// request allocate_slots refuses: first come, first served).
func TestHoldPinnedRequestsWaitFCFS(t *testing.T) {
	reg, clk := sim.NewRegistry(), newEventClock()
	p := start(t, reg, clk, nil)
	d := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks = 8 })
	hold(t, p, d, idPrompt(1, 64), 17) // 64 + 17 - 1 positions: 5 blocks
	st := d.Stats()
	require.Equal(t, 5, st.BlocksPinned)
	require.Equal(t, 5, st.UsedBlocks)
	require.Equal(t, 8, st.TotalBlocks)

	ctx := t.Context()
	a, b := idPrompt(2, 64), idPrompt(3, 16) // 4 blocks (3 free), then 1 block
	ra := async(ctx, clk, d.url, ids(a, 1, nil))
	settle(t, clk, 1)
	rb := async(ctx, clk, d.url, ids(b, 1, nil))
	settle(t, clk, 2)
	st = d.Stats()
	assert.Equal(t, 2, st.Waiting, "vllm:num_requests_waiting")
	assert.Zero(t, st.Running)
	assert.Equal(t, 2, st.Queued)
	assert.Equal(t, 5, st.BlocksPinned, "the hold is not evicted for them")

	run(t, clk) // the TTL's timer lets both in
	require.Equal(t, http.StatusOK, (<-ra).Status)
	require.Equal(t, http.StatusOK, (<-rb).Status)
	ttl := sim.DefaultConfig().DecoderBlocksTTL
	assert.Equal(t, ttl, recordOf(t, d, a).Queued)
	assert.Equal(t, ttl, recordOf(t, d, b).Queued, "it fitted, but waited behind the head of the queue")
	assert.Equal(t, ttl, recordOf(t, d, b).FirstToken)
	st = d.Stats()
	assert.Equal(t, 1, st.TTLExpiries)
	assert.Equal(t, 5, st.TTLBlocks)
	assert.Zero(t, st.BlocksPinned)
	assert.Zero(t, st.WrongOutputs)
}

// A prefill engine likewise: its blocks held for the lease count as used,
// and a request that does not fit waits for the lease to end.
func TestPrefillWaitsForLease(t *testing.T) {
	clk := newEventClock()
	p := start(t, nil, clk, func(c *sim.Config) { c.NumBlocks = 6 })
	rp := post(t, p.url, sim.PathCompletions, ids(idPrompt(1, 64), 1, missHandle()))
	require.NotNil(t, rp.KV)
	require.Equal(t, 4, p.Stats().BlocksPinned)

	next := idPrompt(2, 64)
	r := async(t.Context(), clk, p.url, ids(next, 1, missHandle()))
	settle(t, clk, 1)
	assert.Equal(t, 1, p.Stats().Waiting)
	run(t, clk)
	require.Equal(t, http.StatusOK, (<-r).Status)
	assert.Equal(t, sim.DefaultConfig().LeaseDuration, recordOf(t, p, next).Queued)
	assert.Equal(t, 1, p.Stats().LeaseExpiries)
	assert.Equal(t, 4, p.Stats().LeaseBlocks)
}

// With no free block, the request that needs one preempts the running
// request scheduled last (running.pop() under the FCFS policy, then
// _preempt_request): its blocks are freed, it waits at the front of the
// queue and, when let in again, recomputes its prompt and the tokens it
// generated, less what the prefix cache still holds.
//
// Pool of 8 blocks of 16; A then B, each 48 prompt tokens (3 blocks) and
// 40 generated, prefill 48 ms, 10 ms a step. At 58 ms each takes a 4th
// block (the pool is full). At 218 ms A needs a 5th: B, scheduled last, is
// preempted with 17 tokens generated; A takes one of B's freed blocks (B's
// generated block, its tail, evicted first). At 378 ms A's 6th block
// evicts B's third prompt block. A finishes at 448 ms; B is let in with
// two cached blocks and recomputes positions 32 to 65: 33 tokens, 33 ms.
func TestPreemptsLastScheduled(t *testing.T) {
	clk := newEventClock()
	d := start(t, nil, clk, func(c *sim.Config) { c.NumBlocks = 8; c.Profile = ms })
	a, b := idPrompt(1, 48), idPrompt(2, 48)
	ctx := t.Context()
	ra := async(ctx, clk, d.url, ids(a, 40, nil))
	settle(t, clk, 1)
	rb := async(ctx, clk, d.url, ids(b, 40, nil))
	settle(t, clk, 2)
	run(t, clk)
	resA, resB := <-ra, <-rb
	require.Equal(t, http.StatusOK, resA.Status)
	require.Equal(t, http.StatusOK, resB.Status)

	recA, recB := recordOf(t, d, a), recordOf(t, d, b)
	assert.Zero(t, recA.Preemptions)
	assert.Equal(t, 48*time.Millisecond, recA.FirstToken)
	assert.Equal(t, 1, recB.Preemptions, "the last scheduled is preempted")
	assert.Equal(t, 230*time.Millisecond, recB.Requeued, "from its preemption at 218 ms until A finished")
	assert.Equal(t, ms.LocalPrefill(33, 32), recB.Recompute)
	assert.Equal(t, 48*time.Millisecond, recB.FirstToken, "preempted after its first token")
	assert.False(t, recA.Wrong)
	assert.False(t, recB.Wrong, "recomputation changes the cost, not the answer")
	toks := make([]uint32, len(b))
	for i, id := range b {
		toks[i] = uint32(id)
	}
	assert.Equal(t, sim.RawText(sim.Reference("sim-model", toks, sim.GenParams{MaxTokens: 40, IgnoreEOS: true})), resB.Text)
	st := d.Stats()
	assert.Equal(t, 1, st.Preemptions)
	assert.Equal(t, 33, st.TokensRecomputed)
	assert.Equal(t, 1, metric(t, d.url, "vllm:num_preemptions_total"))
}

// The request that needs a block preempts itself when it was scheduled
// last (preempted_req == request: "No more request to preempt").
//
// Pool of 6: A (40 prompt tokens, 3 blocks, its 4th needed at its 9th
// token) then B (48 tokens, its 4th block needed at once). B needs a block
// at 58 ms, is last, and preempts itself; A runs to the end (at 130 ms it
// takes one of B's freed blocks) and B, let in at 240 ms, recomputes
// positions 32 to 49.
func TestPreemptsItselfWhenLast(t *testing.T) {
	clk := newEventClock()
	d := start(t, nil, clk, func(c *sim.Config) { c.NumBlocks = 6; c.Profile = ms })
	a, b := idPrompt(1, 40), idPrompt(2, 48)
	ctx := t.Context()
	ra := async(ctx, clk, d.url, ids(a, 20, nil))
	settle(t, clk, 1)
	rb := async(ctx, clk, d.url, ids(b, 20, nil))
	settle(t, clk, 2)
	run(t, clk)
	require.Equal(t, http.StatusOK, (<-ra).Status)
	require.Equal(t, http.StatusOK, (<-rb).Status)
	recA, recB := recordOf(t, d, a), recordOf(t, d, b)
	assert.Zero(t, recA.Preemptions)
	assert.Equal(t, 1, recB.Preemptions)
	assert.Equal(t, 182*time.Millisecond, recB.Requeued)
	assert.Equal(t, ms.LocalPrefill(17, 32), recB.Recompute)
	assert.False(t, recB.Wrong)
}

// metric reads one sample of GET /metrics (rank 0's, for per-engine ones).
func metric(t *testing.T, url, name string) int {
	t.Helper()
	v, ok := metricLabels(t, url, name)[""]
	require.True(t, ok, "%s not found", name)
	f, err := strconv.ParseFloat(v, 64)
	require.NoError(t, err)
	return int(f)
}

// metricLabels returns the value of name's first sample (key "") and its
// labels.
func metricLabels(t *testing.T, url, name string) map[string]string {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	sc := bufio.NewScanner(resp.Body)
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		out := map[string]string{}
		rest := strings.TrimPrefix(line, name)
		if strings.HasPrefix(rest, "{") {
			end := strings.Index(rest, "} ")
			for _, kv := range strings.Split(rest[1:end], `",`) {
				k, v, _ := strings.Cut(kv, `="`)
				out[k] = strings.TrimSuffix(v, `"`)
			}
			rest = rest[end+1:]
		}
		out[""] = strings.TrimSpace(rest)
		return out
	}
	return nil
}

// A hold made while a request already waits still lets it in at its TTL:
// the waiting request is admitted when the blocks are freed, whoever held
// them (found by FuzzScheduler: the expiry timer was armed before the new
// hold was known).
func TestWaitingLetInAtLaterHoldsTTL(t *testing.T) {
	reg, clk := sim.NewRegistry(), newEventClock()
	p := start(t, reg, clk, nil)
	d := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks = 8; c.Profile = ms })
	x, y := idPrompt(1, 64), idPrompt(2, 100)
	rp := post(t, p.url, sim.PathCompletions, ids(x, 1, missHandle()))
	require.NotNil(t, rp.KV)
	ctx := t.Context()
	rx := async(ctx, clk, d.url, ids(x, 64, json.RawMessage(rp.KV))) // 127 positions: holds all 8 blocks when done
	settle(t, clk, 1)
	clk.Join()
	ry := make(chan result, 1)
	go func() {
		defer clk.Leave()
		if clk.Sleep(ctx, 10*time.Millisecond) == nil {
			ry <- fetch(ctx, d.url, sim.PathCompletions, ids(y, 1, nil)) // 7 blocks: waits
		}
	}()
	run(t, clk, p, d)
	require.Equal(t, http.StatusOK, (<-rx).Status)
	require.Equal(t, http.StatusOK, (<-ry).Status)
	recX, recY := recordOf(t, d, x), recordOf(t, d, y)
	done := recX.FirstToken + recX.Decode // X's hold starts when X finishes
	assert.Equal(t, done+sim.DefaultConfig().DecoderBlocksTTL-10*time.Millisecond, recY.Queued)
	assert.Equal(t, 1, d.Stats().TTLExpiries)
}
