package sim_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// turnOne runs protocol turn 1 (P with a miss handle, then D) and returns D's
// answer; extra fields go to the D leg.
func turnOne(t *testing.T, p, d *node, body map[string]any, extra ...any) result {
	t.Helper()
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
	require.NotNil(t, rp.KV)
	rd := post(t, d.url, sim.PathChat, with(with(body, extra...), "kv_transfer_params", rp.KV))
	require.Equal(t, http.StatusOK, rd.Status, string(rd.Body))
	require.NotNil(t, rd.KV)
	return rd
}

func noCache(c *sim.Config) { c.PrefixCaching = false }

func lastRecord(n *node) sim.Record { r := n.Records(); return r[len(r)-1] }

// Strict < kv_recompute_threshold: 63 tokens recompute, 64 pull; 0 disables.
func TestRecomputeThresholdBoundary(t *testing.T) {
	tests := []struct {
		count     int
		threshold int
		want      string
	}{
		{63, 64, sim.PullRecompute},
		{64, 64, sim.PullRead},
		{63, 0, sim.PullRead},
		{20, 0, sim.PullRead},
	}
	for _, tt := range tests {
		t.Run(tt.want, func(t *testing.T) {
			reg := sim.NewRegistry()
			p := start(t, reg, nil, func(c *sim.Config) { c.RecomputeThreshold = tt.threshold })
			d := start(t, reg, nil, nil)
			first := chat(msg{"user", words("threshold", 90)})
			nA, err := countChat(first)
			require.NoError(t, err)
			hitP := nA / 16 * 16 // P caches the full blocks of turn 1's prompt
			m := tt.count + 1 + hitP - nA
			require.Positive(t, m)
			rd := turnOne(t, p, d, first, "max_tokens", m, "ignore_eos", true)
			require.Equal(t, "length", rd.Finish)

			second := chat(msg{"user", words("threshold", 90)}, msg{"assistant", rd.Text}, msg{"user", "next"})
			before := d.Stats().TokensPulledOut
			rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV)))
			require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
			rec := lastRecord(p)
			assert.Equal(t, hitP, rec.CachedTokens)
			assert.Equal(t, tt.want, rec.Pull)
			if tt.want == sim.PullRead {
				assert.Equal(t, tt.count, rec.PulledTokens)
				assert.Equal(t, before+tt.count, d.Stats().TokensPulledOut)
			} else {
				assert.Zero(t, rec.PulledTokens)
				assert.Equal(t, before, d.Stats().TokensPulledOut)
			}
			assert.Zero(t, d.Stats().BlocksPinned, "notified either way: D freed")

			rd2 := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", rp.KV))
			require.Equal(t, http.StatusOK, rd2.Status)
			assert.Equal(t, reference(t, sim.PathChat, second).Content, rd2.Text)
			assert.Zero(t, d.Stats().WrongOutputs)
		})
	}
}

func countChat(body any) (int, error) {
	raw, _ := json.Marshal(body)
	req, err := sim.ParseRequest(sim.PathChat, raw)
	if err != nil {
		return 0, err
	}
	return len(req.Prompt), nil
}

// No pull when the local prefix cache already covers what the handle holds.
func TestNoPullWhenCountNotPositive(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, nil)
	first := chat(msg{"user", words("cover", 64)})
	rd := turnOne(t, p, d, first)
	second := chat(msg{"user", words("cover", 64)}, msg{"assistant", rd.Text}, msg{"user", words("more", 64)})
	// P already caches the whole second prompt, more than D's handle holds:
	// min(remote_num_tokens, prompt) - hit <= 0.
	require.Equal(t, http.StatusOK, post(t, p.url, sim.PathChat, second).Status)
	rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV)))
	require.Equal(t, http.StatusOK, rp.Status)
	assert.Equal(t, sim.PullNone, lastRecord(p).Pull)
	assert.Zero(t, d.Stats().BlocksPinned, "still consumed")
}

// A handle read twice reads freed blocks: after D reallocated them the second
// reader gets another conversation's KV and the answer changes silently.
func TestDoubleReadGivesWrongOutput(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, noCache)
	d := start(t, reg, nil, func(c *sim.Config) { c.NumBlocks = 40 })
	first := chat(msg{"user", words("double", 100)})
	rd := turnOne(t, p, d, first)
	second := chat(msg{"user", words("double", 100)}, msg{"assistant", rd.Text}, msg{"user", words("again", 30)})
	hit := with(second, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV))

	r1 := post(t, p.url, sim.PathChat, hit)
	require.Equal(t, http.StatusOK, r1.Status)
	assert.Zero(t, d.Stats().FreedReads)

	// Another conversation on D reuses the freed blocks.
	other := post(t, d.url, sim.PathChat, chat(msg{"user", words("other", 560)}))
	require.Equal(t, http.StatusOK, other.Status, string(other.Body))

	r2 := post(t, p.url, sim.PathChat, hit) // the same handle again: a retry gone wrong
	require.Equal(t, http.StatusOK, r2.Status)
	assert.Equal(t, 1, d.Stats().FreedReads)
	rd2 := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", r2.KV))
	require.Equal(t, http.StatusOK, rd2.Status)
	assert.NotEqual(t, reference(t, sim.PathChat, second).Content, rd2.Text)
	assert.Equal(t, 1, d.Stats().WrongOutputs)
	assert.True(t, lastRecord(d).Wrong)
}

// P declines a read within 5 s of the D handle's expiry (on D's clock) and
// then fails or recomputes per kv_load_failure_policy.
func TestExpiryGuardAndPolicy(t *testing.T) {
	tests := []struct {
		name    string
		policy  string
		advance time.Duration
		status  int
		pull    string
	}{
		{"fresh", sim.PolicyFail, 474 * time.Second, http.StatusOK, sim.PullRead},
		{"fail within 5s", sim.PolicyFail, 476 * time.Second, http.StatusInternalServerError, sim.PullFailed},
		{"fail after expiry", sim.PolicyFail, 481 * time.Second, http.StatusInternalServerError, sim.PullFailed},
		{"recompute within 5s", sim.PolicyRecompute, 476 * time.Second, http.StatusOK, sim.PullFailed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg, clk := sim.NewRegistry(), newClock()
			p := start(t, reg, clk, func(c *sim.Config) { noCache(c); c.KVLoadFailurePolicy = tt.policy })
			d := start(t, reg, clk, nil)
			first := chat(msg{"user", words("expiry", 100)})
			rd := turnOne(t, p, d, first)
			clk.Advance(tt.advance)
			second := chat(msg{"user", words("expiry", 100)}, msg{"assistant", rd.Text}, msg{"user", "more"})
			rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV)))
			require.Equal(t, tt.status, rp.Status, string(rp.Body))
			rec := lastRecord(p)
			assert.Equal(t, tt.pull, rec.Pull)
			assert.Zero(t, d.Stats().ExpiredReads, "never read expired blocks")
			if tt.pull == sim.PullFailed {
				assert.Equal(t, 1, p.Stats().LoadFailures)
				assert.Equal(t, 1, p.Stats().DeclinedReads)
			}
			if tt.status != http.StatusOK {
				var eb struct {
					Error struct {
						Message, Type string
						Code          int
					}
				}
				require.NoError(t, json.Unmarshal(rp.Body, &eb))
				assert.Equal(t, "InternalServerError", eb.Error.Type)
				assert.Equal(t, 500, eb.Error.Code)
				assert.Nil(t, rp.KV)
				assert.Zero(t, p.Stats().BlocksPinned)
				return
			}
			if tt.policy == sim.PolicyRecompute {
				assert.Zero(t, rec.PulledTokens)
				assert.Equal(t, rec.PromptTokens, rec.ComputedTokens)
			}
			rd2 := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", rp.KV))
			require.Equal(t, http.StatusOK, rd2.Status)
			assert.Equal(t, reference(t, sim.PathChat, second).Content, rd2.Text)
		})
	}
}

// An older engine (or a router that drops the expiry) reads expired blocks:
// nothing fails, D counts the expired read.
func TestExpiredReadWithoutGuard(t *testing.T) {
	reg, clk := sim.NewRegistry(), newClock()
	p := start(t, reg, clk, noCache)
	d := start(t, reg, clk, nil)
	first := chat(msg{"user", words("old", 100)})
	rd := turnOne(t, p, d, first)
	clk.Advance(481 * time.Second)
	assert.Zero(t, d.Stats().BlocksPinned, "TTL freed D's blocks")
	assert.Equal(t, 1, d.Stats().TTLExpiries)
	h := asP(t, rd.KV)
	h["remote_blocks_expiry_time"] = nil
	second := chat(msg{"user", words("old", 100)}, msg{"assistant", rd.Text}, msg{"user", "more"})
	rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", h))
	require.Equal(t, http.StatusOK, rp.Status)
	assert.Equal(t, sim.PullRead, lastRecord(p).Pull)
	assert.Equal(t, 1, d.Stats().ExpiredReads)
}

// P frees blocks no decoder read within kv_lease_duration; a late read gets
// whatever the blocks hold by then.
func TestLeaseExpiry(t *testing.T) {
	reg, clk := sim.NewRegistry(), newClock()
	p := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks = 40 })
	d := start(t, reg, clk, nil)
	body := chat(msg{"user", words("lease", 100)})
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.NotNil(t, rp.KV)
	pinned := p.Stats().BlocksPinned
	require.Positive(t, pinned)

	clk.Advance(29 * time.Second)
	assert.Equal(t, pinned, p.Stats().BlocksPinned, "within the lease")
	clk.Advance(2 * time.Second)
	assert.Zero(t, p.Stats().BlocksPinned, "lease over")
	assert.Equal(t, 1, p.Stats().LeaseExpiries)

	other := post(t, p.url, sim.PathChat, chat(msg{"user", words("other", 560)}))
	require.Equal(t, http.StatusOK, other.Status, string(other.Body))
	rd := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV))
	require.Equal(t, http.StatusOK, rd.Status)
	assert.Equal(t, 1, p.Stats().ExpiredReads)
	assert.NotEqual(t, reference(t, sim.PathChat, body).Content, rd.Text)
	assert.Equal(t, 1, d.Stats().WrongOutputs)
}

// A client that edits history (or strips reasoning) breaks the positional
// precondition: P reads D's blocks by position and the answer is wrong, with
// no error anywhere.
func TestEditedHistoryGivesWrongOutput(t *testing.T) {
	tests := []struct {
		name      string
		reasoning bool
		edit      func(string) string
	}{
		{"edited reply", false, func(s string) string { return "edited" + s[strings.Index(s, " "):] }},
		{"stripped reasoning", true, func(s string) string { return s }},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := sim.NewRegistry()
			mod := func(c *sim.Config) { c.Reasoning = tt.reasoning }
			p := start(t, reg, nil, func(c *sim.Config) { mod(c); noCache(c) })
			d := start(t, reg, nil, mod)
			first := chat(msg{"user", words("edit", 100)})
			rd := turnOne(t, p, d, first)
			second := chat(msg{"user", words("edit", 100)}, msg{"assistant", tt.edit(rd.Text)}, msg{"user", words("then", 20)})
			rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV)))
			require.Equal(t, http.StatusOK, rp.Status)
			assert.Equal(t, sim.PullRead, lastRecord(p).Pull)
			rd2 := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", rp.KV))
			require.Equal(t, http.StatusOK, rd2.Status)
			assert.Equal(t, 1, d.Stats().WrongOutputs)
			assert.Zero(t, d.Stats().FreedReads+d.Stats().ExpiredReads, "no counter but WrongOutputs notices")

			// The wrong KV now sits in D's prefix cache under the new
			// prompt's tokens: a plain request there is wrong too.
			plain := post(t, d.url, sim.PathChat, second)
			require.Equal(t, http.StatusOK, plain.Status)
			assert.True(t, lastRecord(d).Wrong)
			// The same conversation on a fresh engine is right.
			fresh := start(t, nil, nil, mod)
			r := post(t, fresh.url, sim.PathChat, second)
			require.Equal(t, http.StatusOK, r.Status)
			assert.False(t, lastRecord(fresh).Wrong)
		})
	}
}

// D frees at once when its client goes away and emits no handle.
func TestAbortFreesDecodeBlocks(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, func(c *sim.Config) {
		c.Profile = sim.Profile{InterTokenLatency: time.Hour}
		c.Speed = 1
	})
	body := chat(msg{"user", words("abort", 60)})
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.NotNil(t, rp.KV)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	raw, _ := json.Marshal(with(body, "stream", true, "kv_transfer_params", rp.KV))
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, d.url+sim.PathChat, bytes.NewReader(raw))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	first, err := bufio.NewReader(resp.Body).ReadString('\n')
	require.NoError(t, err)
	require.Contains(t, first, `"role":"assistant"`)
	// vLLM's connector makes the handle when the request finishes
	// (request_finished); while it decodes D's blocks are the request's own.
	require.Positive(t, d.Stats().UsedBlocks, "D holds blocks while decoding")
	require.Zero(t, d.Stats().HandlesEmitted, "no handle before the request finishes")
	cancel()
	resp.Body.Close()
	require.Eventually(t, func() bool { return d.Stats().Aborted == 1 }, 10*time.Second, 5*time.Millisecond)
	st := d.Stats()
	assert.Zero(t, st.BlocksPinned)
	assert.Zero(t, st.HandlesEmitted)
	rec := lastRecord(d)
	assert.True(t, rec.Aborted)
	assert.Nil(t, rec.Handle)
	assert.Zero(t, p.Stats().BlocksPinned, "P's handle was consumed before the abort")
}

// A bad positional read poisons P's prefix cache: the pulled blocks are
// cached under P's token hashes, so a later request sharing the prefix hits
// wrong KV (counted as a poisoned hit) and answers wrong.
func TestPoisonedPrefixHit(t *testing.T) {
	reg := sim.NewRegistry()
	// prefix caching on; threshold 0 so that P pulls however little it lacks
	p := start(t, reg, nil, func(c *sim.Config) { c.RecomputeThreshold = 0 })
	d := start(t, reg, nil, nil)
	first := chat(msg{"user", words("poison", 100)})
	rd := turnOne(t, p, d, first)
	assert.Zero(t, p.Stats().PoisonedHits)

	// A correct reuse: the right history, P's hit is clean.
	good := chat(msg{"user", words("poison", 100)}, msg{"assistant", rd.Text}, msg{"user", "fine"})
	r := post(t, p.url, sim.PathChat, good)
	require.Equal(t, http.StatusOK, r.Status)
	assert.Positive(t, lastRecord(p).CachedTokens)
	assert.False(t, lastRecord(p).Poisoned)

	// The bad read: edited history, P pulls D's blocks by position.
	second := chat(msg{"user", words("poison", 100)}, msg{"assistant", "edited" + rd.Text[strings.Index(rd.Text, " "):]}, msg{"user", words("then", 40)})
	rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV)))
	require.Equal(t, http.StatusOK, rp.Status)
	require.Equal(t, sim.PullRead, lastRecord(p).Pull)
	assert.Zero(t, p.Stats().PoisonedHits, "the read itself is no hit")
	// Release P's held blocks to the cache (D reads them).
	rd2 := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", rp.KV))
	require.Equal(t, http.StatusOK, rd2.Status)

	// A plain request sharing the prefix now hits the poisoned blocks.
	plain := post(t, p.url, sim.PathChat, with(second, "max_tokens", 5))
	require.Equal(t, http.StatusOK, plain.Status)
	rec := lastRecord(p)
	assert.Positive(t, rec.CachedTokens)
	assert.True(t, rec.Poisoned)
	assert.True(t, rec.Wrong, "the answer is wrong")
	assert.Equal(t, 1, p.Stats().PoisonedHits)
	assert.NotEqual(t, reference(t, sim.PathChat, with(second, "max_tokens", 5)).Content, plain.Text)
}

// With DecodeRecompute the threshold guards D's pull too: D computes a short
// prompt locally and still notifies P, which frees its blocks.
func TestDecodeRecompute(t *testing.T) {
	tests := []struct {
		name string
		on   bool
		pull string
	}{
		{"off: D pulls", false, sim.PullRead},
		{"on: D recomputes", true, sim.PullRecompute},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := sim.NewRegistry()
			mod := func(c *sim.Config) { c.DecodeRecompute = tt.on }
			p := start(t, reg, nil, mod)
			d := start(t, reg, nil, mod)
			body := chat(msg{"user", "short one"}) // well under 64 tokens
			rd := turnOne(t, p, d, body)
			rec := lastRecord(d)
			assert.Equal(t, tt.pull, rec.Pull)
			assert.False(t, rec.Wrong)
			assert.Equal(t, reference(t, sim.PathChat, body).Content, rd.Text)
			assert.Zero(t, p.Stats().BlocksPinned, "P was notified either way")
			if tt.on {
				assert.Zero(t, rec.PulledTokens)
				assert.Zero(t, p.Stats().TokensPulledOut)
			} else {
				assert.Positive(t, rec.PulledTokens)
			}
		})
	}
}

// X-Request-Id falls back to the body's request_id.
func TestRequestIDFallback(t *testing.T) {
	e := start(t, nil, nil, nil)
	r := post(t, e.url, sim.PathChat, with(chat(msg{"user", "hi"}), "request_id", "from-body"))
	require.Equal(t, http.StatusOK, r.Status)
	rec := lastRecord(e)
	assert.Equal(t, "from-body", rec.RequestID)
	assert.Contains(t, string(r.Body), `"id":"chatcmpl-from-body"`)
}
