package sim_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// A hybrid model (full-attention and sliding-window groups of different
// block sizes) exports its full-attention group's block size, and its
// handles carry the full group whole and the sliding-window group's tail
// only (vLLM's get_exchange_clipped_blocks). A next turn that attaches the
// handle as it is reads right; one whose sliding-window list was cut from
// the front, as a partial read cuts a full-attention group, reads the
// wrong blocks; one whose list is shorter than the reader's trips the
// worker's assert.
func TestHybridGroups(t *testing.T) {
	const bs, gbs, window = 16, 64, 100
	mod := func(c *sim.Config) {
		c.KVGroups, c.BlockSize, c.GroupBlockSize, c.SlidingWindow, c.RecomputeThreshold = 2, bs, gbs, window, 0
	}
	for _, tt := range []struct {
		name   string
		edit   func(ids [][]int) [][]int
		status int
		wrong  bool
	}{
		{"intact", func(ids [][]int) [][]int { return ids }, http.StatusOK, false},
		{"window cut from the front", func(ids [][]int) [][]int {
			// The reader's list is as long as the window's: keep that many,
			// but the first ones.
			return [][]int{ids[0], append(append([]int(nil), ids[1][:len(ids[1])-1]...), ids[1][0])}
		}, http.StatusOK, true},
		{"window too short", func(ids [][]int) [][]int { return [][]int{ids[0], ids[1][:1]} }, http.StatusInternalServerError, false},
	} {
		t.Run(tt.name, func(t *testing.T) {
			reg := sim.NewRegistry()
			p := start(t, reg, nil, func(c *sim.Config) { mod(c); noCache(c) })
			d := start(t, reg, nil, func(c *sim.Config) { mod(c); noCache(c) }) // reads P's whole prompt
			metrics := getBody(t, d.url+"/metrics")
			assert.Contains(t, metrics, fmt.Sprintf(`block_size="%d"`, bs))
			assert.Contains(t, metrics, fmt.Sprintf(`effective_attention_block_size="%d"`, bs))
			assert.Contains(t, metrics, fmt.Sprintf(`sliding_window="%d"`, window))

			first := chat(msg{"user", words("hybrid", 300)})
			rd := turnOne(t, p, d, first)
			h := decodeHandle(t, rd.KV)
			var ids [][]int
			raw, _ := json.Marshal(h["remote_block_ids"])
			require.NoError(t, json.Unmarshal(raw, &ids))
			n := int(h["remote_num_tokens"].(float64))
			require.Len(t, ids, 2)
			assert.GreaterOrEqual(t, len(ids[0]), (n+bs-1)/bs, "the full-attention group covers every token")
			assert.Equal(t, (window+gbs-1)/gbs+1, len(ids[1]), "the sliding-window group: the window's tail")

			second := chat(msg{"user", words("hybrid", 300)}, msg{"assistant", rd.Text}, msg{"user", "go on"})
			m := asP(t, rd.KV)
			m["remote_block_ids"] = tt.edit(ids)
			rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", m))
			require.Equal(t, tt.status, rp.Status, string(rp.Body))
			if tt.status != http.StatusOK {
				assert.Equal(t, 1, p.Stats().AssertFailures)
				return
			}
			assert.Equal(t, n, lastRecord(p).PulledTokens)
			rd2 := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", rp.KV))
			require.Equal(t, http.StatusOK, rd2.Status)
			assert.Equal(t, tt.wrong, lastRecord(d).Wrong)
			if !tt.wrong {
				assert.Equal(t, reference(t, sim.PathChat, second).Content, rd2.Text)
			}
		})
	}
}
