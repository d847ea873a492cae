package sim_test

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// How D's hold ends, as vLLM's pull connector decides it: only a P request
// that carries the handle and is scheduled frees it early, by reading or
// by the notify-only path; nothing else does, and a notification for a
// hold that is gone changes nothing.

// pHandle turns D's handle into message 2 (the P leg), with edits.
func pHandle(t *testing.T, h json.RawMessage, edit func(map[string]any)) map[string]any {
	t.Helper()
	m := asP(t, h)
	if edit != nil {
		edit(m)
	}
	return m
}

// The notify-only path: get_num_new_matched_tokens returns 0 external
// tokens (count = min(remote_num_tokens or 0, prompt) - local hit <= 0, or
// below kv_recompute_threshold), update_state_after_alloc still records
// the request in _reqs_need_recv with no local blocks, and the worker's
// _read_blocks sends the notification alone, without looking at the
// expiry (_is_turn2_read_expired is false with no local blocks): D frees
// the whole hold, nothing is read, P computes its prompt.
func TestNotifyOnlyFreesTheHold(t *testing.T) {
	prompt := idPrompt(1, 96)
	next := append(append([]int(nil), prompt...), idPrompt(9, 40)...)
	tests := []struct {
		name    string
		edit    func(map[string]any)
		advance time.Duration // before the P leg
		warm    bool          // P's prefix cache holds the whole next prompt
		pull    string
	}{
		{"remote_num_tokens 0", func(m map[string]any) { m["remote_num_tokens"] = 0 }, 0, false, sim.PullNone},
		// params.get("remote_num_tokens") or 0: absent or null reads nothing
		{"remote_num_tokens absent", func(m map[string]any) { delete(m, "remote_num_tokens") }, 0, false, sim.PullNone},
		{"remote_num_tokens null", func(m map[string]any) { m["remote_num_tokens"] = nil }, 0, false, sim.PullNone},
		{"remote_num_tokens 0 near expiry", func(m map[string]any) { m["remote_num_tokens"] = 0 }, 477 * time.Second, false, sim.PullNone},
		{"below the threshold", func(m map[string]any) { m["remote_num_tokens"] = 63 }, 0, false, sim.PullRecompute},
		{"local prefix hit covers it", nil, 0, true, sim.PullNone},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg, clk := sim.NewRegistry(), newClock()
			// P with prefix caching off (as published) but for the case
			// of a local hit
			p := start(t, reg, clk, func(c *sim.Config) { c.PrefixCaching = tt.warm })
			d := start(t, reg, clk, nil)
			h := hold(t, p, d, prompt, 17)
			held := d.Stats().BlocksPinned
			require.Positive(t, held)
			if tt.warm {
				require.Equal(t, http.StatusOK, post(t, p.url, sim.PathCompletions, ids(next, 1, nil)).Status)
			}
			clk.Advance(tt.advance)
			rp := post(t, p.url, sim.PathCompletions, ids(next, 1, pHandle(t, h, tt.edit)))
			require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
			rec := lastRecord(p)
			assert.Equal(t, tt.pull, rec.Pull)
			assert.Zero(t, rec.PulledTokens)
			st := d.Stats()
			assert.Zero(t, st.TokensPulledOut, "nothing read")
			assert.Equal(t, 1, st.NotifiedHolds)
			assert.Equal(t, held, st.NotifiedBlocks, "the whole hold freed")
			assert.Zero(t, st.BlocksPinned)
			assert.Zero(t, p.Stats().DeclinedReads)
		})
	}
}

// No notification, D holds to its TTL: a read P declines because the
// handle is within 5 s of its expiry (_is_turn2_read_expired, then
// _handle_failed_transfer), a read that fails (the notification rides on
// the READ transfer), and a P request rejected before it reaches the
// scheduler (4xx).
func TestNoNotifyHoldsToTTL(t *testing.T) {
	prompt := idPrompt(1, 96)
	next := append(append([]int(nil), prompt...), idPrompt(9, 40)...)
	tests := []struct {
		name    string
		edit    func(map[string]any)
		body    func(map[string]any) map[string]any
		advance time.Duration
		status  int
	}{
		{"declined near expiry", nil, nil, 476 * time.Second, http.StatusInternalServerError},
		{"failed read", func(m map[string]any) {
			// blocks out of range on D: the transfer fails
			m["remote_block_ids"] = [][]int{{9000, 9001, 9002, 9003, 9004, 9005, 9006, 9007}}
		}, nil, 0, http.StatusInternalServerError},
		{"rejected 400", nil, func(m map[string]any) map[string]any {
			return with(m, "max_tokens", 1<<20) // beyond max_model_len
		}, 0, http.StatusBadRequest},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg, clk := sim.NewRegistry(), newClock()
			p := start(t, reg, clk, noCache)
			d := start(t, reg, clk, nil)
			h := hold(t, p, d, prompt, 17)
			held := d.Stats().BlocksPinned
			clk.Advance(tt.advance)
			body := ids(next, 1, pHandle(t, h, tt.edit))
			if tt.body != nil {
				body = tt.body(body)
			}
			rp := post(t, p.url, sim.PathCompletions, body)
			require.Equal(t, tt.status, rp.Status, string(rp.Body))
			st := d.Stats()
			assert.Zero(t, st.NotifiedHolds)
			assert.Zero(t, st.StaleNotifies)
			assert.Equal(t, held, st.BlocksPinned, "D still holds")
			clk.Advance(sim.DefaultConfig().DecoderBlocksTTL)
			st = d.Stats()
			assert.Zero(t, st.BlocksPinned)
			assert.Equal(t, 1, st.TTLExpiries)
			assert.Equal(t, held, st.TTLBlocks)
		})
	}
}

// A P request given up while it waits for blocks was never scheduled:
// request_finished finds no update_state_after_alloc done (the request is
// only in _reqs_not_processed), so no notification; D holds to its TTL.
func TestQueuedPrefillAbortedDoesNotNotify(t *testing.T) {
	reg, clk := sim.NewRegistry(), newEventClock()
	p := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks = 16 })
	d := start(t, reg, clk, nil)
	prompt := idPrompt(1, 96)
	h := hold(t, p, d, prompt, 17) // P frees its lease: D read it
	held := d.Stats().BlocksPinned
	// P's pool filled by a lease (10 blocks): the next turn (9) waits
	filler := post(t, p.url, sim.PathCompletions, ids(idPrompt(2, 160), 1, missHandle()))
	require.NotNil(t, filler.KV)

	ctx, cancel := context.WithCancel(t.Context())
	next := append(append([]int(nil), prompt...), idPrompt(9, 40)...)
	r := async(ctx, clk, p.url, ids(next, 1, pHandle(t, h, nil)))
	settle(t, clk, 1)
	require.Equal(t, 1, p.Stats().Waiting)
	cancel()
	require.Equal(t, -1, (<-r).Status)
	require.Eventually(t, func() bool { return p.Stats().Aborted == 1 }, 10*time.Second, 5*time.Millisecond)
	assert.Zero(t, p.Stats().Waiting)
	st := d.Stats()
	assert.Zero(t, st.NotifiedHolds)
	assert.Equal(t, held, st.BlocksPinned, "D still holds")
	assert.Zero(t, p.Stats().TokensPulledIn)
}

// A D request given up while it waits for blocks still frees P's blocks:
// request_finished finds do_remote_prefill still set and queues an empty
// read, whose notification frees P's (the abort path of rejected KV
// transfer requests).
func TestQueuedDecodeAbortedNotifiesPrefill(t *testing.T) {
	reg, clk := sim.NewRegistry(), newEventClock()
	p := start(t, reg, clk, nil)
	d := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks = 8 })
	hold(t, p, d, idPrompt(1, 64), 17) // 5 of D's 8 blocks
	next := idPrompt(2, 64)
	rp := post(t, p.url, sim.PathCompletions, ids(next, 1, missHandle()))
	require.NotNil(t, rp.KV)
	leased, notified, out := p.Stats().BlocksPinned, p.Stats().NotifiedHolds, p.Stats().TokensPulledOut
	require.Positive(t, leased)

	ctx, cancel := context.WithCancel(t.Context())
	r := async(ctx, clk, d.url, ids(next, 8, json.RawMessage(rp.KV)))
	settle(t, clk, 1)
	require.Equal(t, 1, d.Stats().Waiting)
	cancel()
	require.Equal(t, -1, (<-r).Status)
	require.Eventually(t, func() bool { return p.Stats().NotifiedHolds == notified+1 }, 10*time.Second, 5*time.Millisecond)
	assert.Zero(t, p.Stats().BlocksPinned, "P freed its lease at once")
	assert.Zero(t, p.Stats().LeaseExpiries)
	assert.Equal(t, out, p.Stats().TokensPulledOut, "nothing read")
}

// A notification for a hold already freed (consumed, expired) or never
// known changes nothing: _get_new_notifs logs "Potentially invalid KV
// blocks for unrecognized request" and skips it.
func TestStaleNotifyIsHarmless(t *testing.T) {
	reg, clk := sim.NewRegistry(), newClock()
	p := start(t, reg, clk, nil)
	d := start(t, reg, clk, nil)
	h1 := hold(t, p, d, idPrompt(1, 64), 17)
	h2 := hold(t, p, d, idPrompt(2, 64), 17)
	var p1, p2 sim.Params
	for _, x := range []struct {
		raw json.RawMessage
		out *sim.Params
	}{{h1, &p1}, {h2, &p2}} {
		parsed, err := sim.ParseParams(x.raw)
		require.NoError(t, err)
		*x.out = *parsed
	}
	ctx := t.Context()
	pinned := d.Stats().BlocksPinned
	require.NoError(t, d.Notify(ctx, p1.EngineID, p1.RequestID))
	once := d.Stats()
	assert.Equal(t, 1, once.NotifiedHolds)
	require.NoError(t, d.Notify(ctx, p1.EngineID, p1.RequestID), "again")
	require.NoError(t, d.Notify(ctx, p1.EngineID, "no-such-request"))
	clk.Advance(sim.DefaultConfig().DecoderBlocksTTL) // h2 expires
	require.NoError(t, d.Notify(ctx, p2.EngineID, p2.RequestID), "after the TTL")
	st := d.Stats()
	assert.Equal(t, 1, st.NotifiedHolds)
	assert.Equal(t, 3, st.StaleNotifies)
	assert.Equal(t, pinned-once.BlocksPinned, st.NotifiedBlocks)
	assert.Equal(t, 1, st.TTLExpiries)
	assert.Zero(t, st.BlocksPinned)
	assert.Zero(t, st.FreedReads)
}

// While a D request waits for blocks, D's heartbeats (every
// kv_lease_duration/6 of D's setting, base_scheduler's _heartbeat_by_engine
// and the worker's _send_heartbeats) renew P's lease, so P's blocks are
// still there when D reads them, 100 s later. A D whose lease setting makes
// it beat less often than P's lease lets them expire: D reads what P's
// freed blocks hold by then, and answers wrong.
func TestHeartbeatKeepsPrefillLease(t *testing.T) {
	for _, tt := range []struct {
		name   string
		dLease time.Duration
		wrong  bool
	}{
		{"beats every 5 s", 30 * time.Second, false},
		{"beats every 10 min", time.Hour, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			reg, clk := sim.NewRegistry(), newEventClock()
			p := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks = 12; c.PrefixCaching = false })
			d := start(t, reg, clk, func(c *sim.Config) {
				c.NumBlocks = 8
				c.DecoderBlocksTTL = 100 * time.Second
				c.LeaseDuration = tt.dLease
			})
			hold(t, p, d, idPrompt(1, 64), 17) // 5 of D's 8 blocks until 100 s
			next := idPrompt(2, 64)
			rp := post(t, p.url, sim.PathCompletions, ids(next, 1, missHandle()))
			require.NotNil(t, rp.KV)

			ctx := t.Context()
			r := async(ctx, clk, d.url, ids(next, 8, json.RawMessage(rp.KV)))
			settle(t, clk, 1)
			// At 60 s a request needs all of P's blocks: with the lease
			// renewed it waits for D's read; with the lease over it takes
			// the blocks D has yet to read.
			clk.Join()
			go func() {
				defer clk.Leave()
				if clk.Sleep(ctx, 60*time.Second) == nil {
					fetch(ctx, p.url, sim.PathCompletions, ids(idPrompt(3, 176), 1, nil))
				}
			}()
			run(t, clk)
			res := <-r
			require.Equal(t, http.StatusOK, res.Status, string(res.Body))
			rec := recordOf(t, d, next)
			assert.Equal(t, 100*time.Second, rec.Queued)
			assert.Equal(t, tt.wrong, rec.Wrong)
			if tt.wrong {
				assert.Equal(t, 1, p.Stats().LeaseExpiries)
			} else {
				assert.Zero(t, p.Stats().LeaseExpiries)
				assert.Zero(t, p.Stats().ExpiredReads+p.Stats().FreedReads)
			}
		})
	}
}

// A decode request (do_remote_prefill) reads its whole prompt less its
// local hit whatever remote_num_tokens says: get_num_new_matched_tokens's
// remote-prefill branch counts the prompt (_get_remote_prefill_token_count)
// and never reads the key.
func TestDecodeReadsWholePromptIgnoringRemoteNumTokens(t *testing.T) {
	prompt := idPrompt(3, 96)
	for name, edit := range map[string]func(map[string]any){
		"as emitted": nil,
		"absent":     func(m map[string]any) { delete(m, "remote_num_tokens") },
		"zero":       func(m map[string]any) { m["remote_num_tokens"] = 0 },
		"smaller":    func(m map[string]any) { m["remote_num_tokens"] = 10 },
	} {
		t.Run(name, func(t *testing.T) {
			reg := sim.NewRegistry()
			p := start(t, reg, nil, nil)
			d := start(t, reg, nil, nil)
			rp := post(t, p.url, sim.PathCompletions, ids(prompt, 1, missHandle()))
			require.NotNil(t, rp.KV)
			var h map[string]any
			require.NoError(t, json.Unmarshal(rp.KV, &h))
			if edit != nil {
				edit(h)
			}
			rd := post(t, d.url, sim.PathCompletions, ids(prompt, 8, h))
			require.Equal(t, http.StatusOK, rd.Status, string(rd.Body))
			rec := lastRecord(d)
			assert.Equal(t, sim.PullRead, rec.Pull)
			assert.Equal(t, len(prompt), rec.PulledTokens, "the whole prompt")
			assert.Equal(t, len(prompt), p.Stats().TokensPulledOut)
			assert.Zero(t, p.Stats().BlocksPinned, "P notified")
			assert.False(t, rec.Wrong)
		})
	}
}

// An engine without a KV connector (no --kv-transfer-config: the
// scheduler's connector is None) serves every request as a plain one:
// kv_transfer_params are never looked at, nothing is read, held or
// notified, and the answer's kv_transfer_params is null.
func TestNoKVConnectorIgnoresParams(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, nil)
	plain := start(t, reg, nil, func(c *sim.Config) { c.NoKVConnector = true })
	prompt := idPrompt(4, 96)

	r := post(t, plain.url, sim.PathCompletions, ids(prompt, 1, missHandle()))
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	assert.Nil(t, r.KV, "no P handle")
	h := hold(t, p, d, prompt, 9)
	before := d.Stats()
	r = post(t, plain.url, sim.PathCompletions, ids(prompt, 4, pHandle(t, h, nil)))
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	assert.Nil(t, r.KV)
	st := plain.Stats()
	assert.Equal(t, 2, st.PlainRequests)
	assert.Zero(t, st.PrefillRequests+st.DecodeRequests)
	assert.Zero(t, st.TokensPulledIn+st.BlocksPinned)
	after := d.Stats()
	assert.Equal(t, before.BlocksPinned, after.BlocksPinned, "D's hold untouched: no notification")
	assert.Zero(t, after.NotifiedHolds)
}
