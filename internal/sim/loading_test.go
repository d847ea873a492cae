package sim_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// Requests loading KV from a remote against vLLM's v1 scheduler
// (vllm/v1/core/sched/scheduler.py, Scheduler.schedule): a request whose
// get_num_new_matched_tokens says load_kv_async is allocated its blocks
// and put back in the waiting queue as WAITING_FOR_REMOTE_KVS; only
// self.running counts toward max_num_seqs; once its KV arrived it is
// scheduled from the queue like any waiting request.

// slow is ms with a KV read of 100 ms.
var slow = sim.Profile{PrefillPerToken: time.Millisecond, InterTokenLatency: 10 * time.Millisecond, TransferFixed: 100 * time.Millisecond}

// pHandleFor prefills prompt on p with the miss handle and returns P's
// handle, for a decode leg.
func pHandleFor(t *testing.T, p *node, prompt []int) any {
	t.Helper()
	rp := post(t, p.url, sim.PathCompletions, ids(prompt, 1, missHandle()))
	require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
	require.NotNil(t, rp.KV)
	return rp.KV
}

// --max-num-seqs 1: a decode leg reading from P takes no running slot, so
// a plain request arriving meanwhile runs at once; the decode leg, its KV
// read at 100 ms, then waits for the slot until the plain request ends
// (32 ms of prefill and 20 steps: 232 ms).
func TestLoadingTakesNoRunningSlot(t *testing.T) {
	reg, clk := sim.NewRegistry(), newEventClock()
	p := start(t, reg, clk, nil)
	d := start(t, reg, clk, func(c *sim.Config) { c.MaxNumSeqs = 1; c.Profile = slow })
	l, w := idPrompt(1, 64), idPrompt(2, 32)
	kv := pHandleFor(t, p, l)
	ctx := t.Context()
	rl := async(ctx, clk, d.url, ids(l, 4, kv))
	settle(t, clk, 1)
	rw := async(ctx, clk, d.url, ids(w, 20, nil))
	settle(t, clk, 2)
	st := d.Stats()
	assert.Equal(t, 1, st.Running, "the plain request runs")
	assert.Equal(t, 1, st.Waiting, "the decode leg loads: waiting (WAITING_FOR_REMOTE_KVS)")
	run(t, clk, p, d)
	require.Equal(t, http.StatusOK, (<-rl).Status)
	require.Equal(t, http.StatusOK, (<-rw).Status)
	recL, recW := recordOf(t, d, l), recordOf(t, d, w)
	assert.Zero(t, recW.Queued, "admitted while the decode leg loads")
	assert.Equal(t, 100*time.Millisecond, recL.Transfer)
	assert.Equal(t, 132*time.Millisecond, recL.Queued, "read at 100 ms, a slot at 232 ms")
	assert.Equal(t, 232*time.Millisecond+slow.Prefill(1, 63), recL.FirstToken)
	assert.Zero(t, d.Stats().WrongOutputs)
}

// A request whose KV arrived waits in skipped_waiting, which the
// first-come-first-served policy scans before the waiting queue
// (_select_waiting_queue_for_scheduling): it runs ahead of a preempted
// request at the head of the waiting queue that cannot fit.
//
// Pool of 8 blocks of 16; A and V, 48 prompt tokens each (3 blocks), and L,
// a decode leg of 16 tokens (1 block, its read 300 ms). At 58 ms A takes
// the last free block and V, scheduled last, preempts itself; it cannot fit
// again until A finishes at 448 ms. L's KV arrives at 300 ms and it runs at
// once.
func TestLoadedRunsAheadOfPreempted(t *testing.T) {
	reg, clk := sim.NewRegistry(), newEventClock()
	prof := ms
	prof.TransferFixed = 300 * time.Millisecond
	p := start(t, reg, clk, nil)
	d := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks = 8; c.Profile = prof })
	a, v, l := idPrompt(1, 48), idPrompt(2, 48), idPrompt(3, 16)
	kv := pHandleFor(t, p, l)
	ctx := t.Context()
	ra := async(ctx, clk, d.url, ids(a, 40, nil))
	settle(t, clk, 1)
	rv := async(ctx, clk, d.url, ids(v, 40, nil))
	settle(t, clk, 2)
	rl := async(ctx, clk, d.url, ids(l, 1, kv))
	settle(t, clk, 3)
	run(t, clk, p, d)
	for _, r := range []<-chan result{ra, rv, rl} {
		require.Equal(t, http.StatusOK, (<-r).Status)
	}
	recA, recV, recL := recordOf(t, d, a), recordOf(t, d, v), recordOf(t, d, l)
	require.Zero(t, recA.Preemptions)
	require.Equal(t, 1, recV.Preemptions)
	assert.Equal(t, 390*time.Millisecond, recV.Requeued, "from 58 ms until A finished at 448 ms")
	assert.Zero(t, recL.Queued, "read at 300 ms, run at once")
	assert.Zero(t, d.Stats().WrongOutputs)
}

// Nothing is admitted in the step of a preemption (Scheduler.schedule runs
// its waiting loop only "if not preempted_reqs"), not even a request whose
// KV has been read, for which the preemption freed a running slot: it
// runs one decode step later.
//
// --max-num-seqs 2, a pool of 7 blocks of 16: L, a decode leg of 16
// tokens, is admitted to read its KV (30 ms); A and V, 48 prompt tokens
// each, take the two running slots; L, read, waits for one. At 58 ms A
// takes the last free block and V preempts itself, freeing a slot; L runs
// at 68 ms, the next step.
func TestNothingAdmittedInPreemptionStep(t *testing.T) {
	reg, clk := sim.NewRegistry(), newEventClock()
	prof := ms
	prof.TransferFixed = 30 * time.Millisecond
	p := start(t, reg, clk, nil)
	d := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks, c.MaxNumSeqs, c.Profile = 7, 2, prof })
	a, v, l := idPrompt(1, 48), idPrompt(2, 48), idPrompt(3, 16)
	kv := pHandleFor(t, p, l)
	ctx := t.Context()
	rl := async(ctx, clk, d.url, ids(l, 1, kv))
	settle(t, clk, 1)
	ra := async(ctx, clk, d.url, ids(a, 40, nil))
	settle(t, clk, 2)
	rv := async(ctx, clk, d.url, ids(v, 40, nil))
	settle(t, clk, 3)
	run(t, clk, p, d)
	for _, r := range []<-chan result{ra, rv, rl} {
		require.Equal(t, http.StatusOK, (<-r).Status)
	}
	recV, recL := recordOf(t, d, v), recordOf(t, d, l)
	assert.Zero(t, recordOf(t, d, a).Queued)
	assert.Zero(t, recV.Queued, "L, loading, took no slot")
	require.Equal(t, 1, recV.Preemptions)
	assert.Equal(t, 38*time.Millisecond, recL.Queued, "read at 30 ms, a slot at 58 ms, admitted at 68 ms")
	assert.Zero(t, d.Stats().WrongOutputs)
}
