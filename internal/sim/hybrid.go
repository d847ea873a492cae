package sim

import (
	"context"
	"fmt"
	"slices"
)

// Hybrid models: KV-cache groups of several block sizes. vLLM puts the
// layers of one attention type in one KV-cache group and gives every group
// pages of one size: a group whose layers' page is smaller gets a block
// size that many times larger (vllm/v1/core/kv_cache_utils.py,
// unify_kv_cache_spec_page_size). A model with full-attention and
// sliding-window layers thus has a full-attention group at --block-size
// (group 0 here, vllm:cache_config_info's block_size and
// effective_attention_block_size) and a sliding-window group at a multiple
// of it (Config.GroupBlockSize). Its handles carry one list per group:
// the full-attention group one id per block of the whole sequence, a
// sliding-window group only its in-window tail, cdiv(window, its block
// size) + 1 ids (NixlBaseConnectorScheduler.get_exchange_clipped_blocks,
// blocks_per_sw, in vllm/distributed/kv_transfer/kv_connector/v1/nixl/
// base_scheduler.py; request_finished in pull_scheduler.py emits them). A
// reader clips its own new blocks the same way and reads the tail of each
// remote group as long as its local list, after asserting it is not
// longer (len(local) <= len(remote), per group).

// hybrid reports whether the groups after the first differ from it (a
// block size of their own, or a sliding window).
func (c *Config) hybrid() bool {
	return c.SlidingWindow > 0 || (c.GroupBlockSize > 0 && c.GroupBlockSize != c.BlockSize)
}

// groupBlockSize is the block size of KV group g.
func (c *Config) groupBlockSize(g int) int {
	if g == 0 || c.GroupBlockSize <= 0 {
		return c.BlockSize
	}
	return c.GroupBlockSize
}

// windowBlocks is how many blocks of group g a handle carries and a reader
// reads at most (0: all): cdiv(window, block size) + 1 for a
// sliding-window group.
func (c *Config) windowBlocks(g int) int {
	if g == 0 || c.SlidingWindow <= 0 {
		return 0
	}
	bs := c.groupBlockSize(g)
	return (c.SlidingWindow+bs-1)/bs + 1
}

// hybridLocal is the length of a reader's own list of group g for a pull
// of count tokens from position hit: its new blocks of the group's size,
// clipped to the window.
func (c *Config) hybridLocal(g, hit, count int) int {
	bs := c.groupBlockSize(g)
	n := (hit+count-1)/bs - hit/bs + 1
	if w := c.windowBlocks(g); w > 0 {
		n = min(n, w)
	}
	return n
}

// hybridGroup returns group g's block ids for a sequence whose blocks (of
// BlockSize tokens) are seqIDs: one id per block of the group's size,
// named by the first of the sequence's blocks it spans, clipped to the
// window's tail.
func (e *Engine) hybridGroup(p *pool, seqIDs []int, g int) []int {
	m := e.cfg.groupBlockSize(g) / e.cfg.BlockSize
	out := make([]int, 0, (len(seqIDs)+m-1)/m)
	for j := 0; j*m < len(seqIDs); j++ {
		out = append(out, p.groupID(seqIDs[j*m], g))
	}
	if w := e.cfg.windowBlocks(g); w > 0 && len(out) > w {
		out = out[len(out)-w:]
	}
	return out
}

// readHybrid reads group g (g >= 1) of a hybrid handle for a pull of count
// tokens from position hit: the tail of remote as long as the reader's own
// clipped list. Each block read must hold the KV of the full-attention
// group's block at its position (data holds group 0's blocks from first
// on): a list cut or clipped at the wrong end reads other blocks, and the
// combined KV is wrong. It returns errAssert when remote is shorter than
// the reader's list.
func (e *Engine) readHybrid(ctx context.Context, peer Peer, p *Params, g, hit, count, first int, data [][]uint64) error {
	bs := e.cfg.groupBlockSize(g)
	m := bs / e.cfg.BlockSize
	last := (hit + count - 1) / bs
	n := e.cfg.hybridLocal(g, hit, count)
	ids := p.Groups[g]
	if len(ids) < n {
		return fmt.Errorf("%w: group %d: len(local) %d > len(remote) %d", errAssert, g, n, len(ids))
	}
	gd, err := peer.Read(ctx, p.EngineID, p.RequestID, ids[len(ids)-n:], 0)
	if err != nil {
		return err
	}
	for i := range gd {
		// The block read is named by the first of the sequence's blocks
		// it spans: group 0's block k there holds the same KV when it is
		// the right one. A wrong one spoils the KV of every position it
		// spans.
		k := (last-n+1+i)*m - first
		if k < 0 || k >= len(data) || slices.Equal(gd[i], data[k]) {
			continue // right, or within the reader's own prefix
		}
		for j := k; j < min(k+m, len(data)); j++ {
			for s := range data[j] {
				data[j][s] = splitmix(data[j][s] ^ 0xbad)
			}
		}
	}
	return nil
}
