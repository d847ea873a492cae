package sim_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// cutHandle lowers a D handle to r tokens, as P's request for a partial
// read, cutting each listed group (nil: every group) from the front to keep
// blocks.
func cutHandle(t *testing.T, h json.RawMessage, r, keep int, groups ...int) map[string]any {
	t.Helper()
	m := asP(t, h)
	m["remote_num_tokens"] = r
	var ids [][]int
	raw, _ := json.Marshal(m["remote_block_ids"])
	require.NoError(t, json.Unmarshal(raw, &ids))
	cut := map[int]bool{}
	for _, g := range groups {
		cut[g] = true
	}
	for g := range ids {
		if keep >= 0 && (len(groups) == 0 || cut[g]) {
			ids[g] = ids[g][:keep]
		}
	}
	m["remote_block_ids"] = ids
	return m
}

// Partial reads as vLLM does them: remote_num_tokens lowered to R' with every
// group cut from the front to ceil(R'/B) blocks reads correctly; a lowered
// count over an uncut list reads the last blocks (wrong, silently); a group
// shorter than what P allocates trips the worker's assert and restarts P.
func TestPartialReads(t *testing.T) {
	const bs = 16
	tests := []struct {
		name    string
		groups  int
		r       int // R'
		keep    int // blocks kept per cut group; -1: uncut
		cut     []int
		status  int
		wrong   bool
		asserts int
	}{
		{"cut aligned", 1, 64, 4, nil, http.StatusOK, false, 0},
		{"cut partial block", 1, 70, 5, nil, http.StatusOK, false, 0},
		{"lowered count, uncut list", 1, 64, -1, nil, http.StatusOK, true, 0},
		{"group too short", 1, 64, 3, nil, http.StatusInternalServerError, false, 1},
		{"two groups cut", 2, 64, 4, nil, http.StatusOK, false, 0},
		{"two groups, one cut", 2, 64, 4, []int{0}, http.StatusOK, true, 0},
		{"two groups, one too short", 2, 64, 3, []int{1}, http.StatusInternalServerError, false, 1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reg := sim.NewRegistry()
			mod := func(c *sim.Config) { c.KVGroups, c.BlockSize, c.RecomputeThreshold = tt.groups, bs, 0 }
			p := start(t, reg, nil, func(c *sim.Config) { mod(c); noCache(c) })
			d := start(t, reg, nil, mod)
			first := chat(msg{"user", words("partial", 120)})
			rd := turnOne(t, p, d, first)
			h := decodeHandle(t, rd.KV)
			ids := h["remote_block_ids"].([]any)
			require.Len(t, ids, tt.groups)
			for _, g := range ids {
				assert.Len(t, g, len(ids[0].([]any)), "groups of equal length")
			}
			full := int(h["remote_num_tokens"].(float64))
			require.Greater(t, full, tt.r+bs)

			second := chat(msg{"user", words("partial", 120)}, msg{"assistant", rd.Text}, msg{"user", "go on"})
			oldID := p.EngineID()
			rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", cutHandle(t, rd.KV, tt.r, tt.keep, tt.cut...)))
			assert.Equal(t, tt.status, rp.Status, string(rp.Body))
			assert.Equal(t, tt.asserts, p.Stats().AssertFailures)
			if tt.status != http.StatusOK {
				assert.Contains(t, string(rp.Body), "EngineCore encountered an issue")
				assert.NotEqual(t, oldID, p.EngineID(), "the engine restarted")
				assert.Equal(t, 1, p.Stats().Restarts)
				assert.Positive(t, d.Stats().BlocksPinned, "a dead worker notifies nobody")
				return
			}
			rec := lastRecord(p)
			assert.Equal(t, tt.r, rec.PulledTokens, "only R' tokens pulled")
			assert.Less(t, rec.PulledTokens, full)
			assert.Zero(t, d.Stats().BlocksPinned, "D freed the whole request")
			rd2 := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", rp.KV))
			require.Equal(t, http.StatusOK, rd2.Status)
			assert.Equal(t, tt.wrong, lastRecord(d).Wrong)
			if !tt.wrong {
				assert.Equal(t, reference(t, sim.PathChat, second).Content, rd2.Text)
			}
		})
	}
}

// A handle whose group count differs from the reader's trips the assert too
// (a simulator rule: vLLM pairs groups by index).
func TestGroupCountMismatch(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, func(c *sim.Config) { c.KVGroups = 2; noCache(c); c.RecomputeThreshold = 0 })
	d := start(t, reg, nil, nil)
	first := chat(msg{"user", words("groups", 80)})
	rp := post(t, d.url, sim.PathChat, with(first, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.Equal(t, http.StatusOK, rp.Status)
	rd := post(t, p.url, sim.PathChat, with(first, "kv_transfer_params", rp.KV))
	assert.Equal(t, http.StatusInternalServerError, rd.Status)
	assert.Equal(t, 1, p.Stats().AssertFailures)
}
