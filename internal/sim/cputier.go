package sim

import (
	"container/list"
	"hash/fnv"
	"strings"
)

// The CPU tier: vLLM's OffloadingConnector (vllm/distributed/kv_transfer/
// kv_connector/v1/offloading/scheduler.py, OffloadingConnectorScheduler;
// vllm/v1/kv_offload/cpu/manager.py, CPUOffloadingManager) behind the
// NixlConnector in a MultiConnector, as docs/cpu-tier.md describes it:
//
//   - Write-through: after every step the chunks that became full are
//     stored (_build_store_jobs): offloadable tokens = min(computed, the
//     request's tokens), capped by the prompt when offload_prompt_only
//     (_calc_num_offloadable_tokens); only whole chunks
//     (storable_chunks), so a partial last chunk stays on the GPU.
//     Stores are deduplicated by key (prepare_store skips stored keys);
//     when the tier cannot evict enough, prepare_store returns None: the
//     batch is not stored, vllm:kv_offload_allocation_failure counts it,
//     and the chunks are tried again at the next step (the stored index
//     does not advance).
//   - Eviction: LRU over chunks with no reference (cpu/policies/lru.py);
//     chunks being loaded are pinned, keys of the batch being stored are
//     protected. touch walks a request's keys in reverse, so within a
//     request the tail is evicted before the head.
//   - Keys: a chunk's key is the prefix-cache block hash of its last GPU
//     block (RequestOffloadState.update_offload_keys, make_offload_key);
//     block hashes chain the parent hash, the block's tokens and extra
//     keys (cache_salt on the first block) from NONE_HASH, which the hash
//     seed and algorithm decide (kv_cache_utils.py, init_none_hash).
//   - Lookup (get_num_new_matched_tokens, _lookup, _maximal_prefix_lookup):
//     after the GPU prefix-cache hit, from chunk hit/chunk on, consecutive
//     hits end at the first miss; fewer than one chunk beyond the hit is no
//     hit. Loaded chunks become GPU prefix-cache blocks.
//
// What is not modelled: stores complete at once (the device-to-host copy
// is priced on /metrics only, never delaying a request), HIT_PENDING and
// RETRY deferrals, store_threshold, ARC, max_offload_tokens, KV events.

// Hash algorithms of CPUTier.HashAlgo (--prefix-caching-hash-algo).
const (
	HashSHA256 = "sha256"
	HashXXHash = "xxhash"
)

// DefaultP2PPort is VLLM_P2P_SIDE_CHANNEL_PORT's default, the peer tier's
// base port (rank k listens on it + k).
const DefaultP2PPort = 5710

// CPUTier configures the offloading connector of an engine run with
// MultiConnector(NixlConnector, OffloadingConnector). The zero value is no
// CPU tier.
type CPUTier struct {
	// Chunks is the tier's capacity in chunks per data-parallel rank
	// (cpu_bytes_to_use over the bytes of one chunk). 0: no tier.
	Chunks int
	// BlocksPerChunk is the chunk in GPU blocks (kv_connector_extra_config
	// block_size = BlocksPerChunk × --block-size). 0 means 1.
	BlocksPerChunk int
	// OffloadGenerated is offload_prompt_only false: generated chunks are
	// stored too. false (vLLM's default offload_prompt_only true): only
	// prompt chunks.
	OffloadGenerated bool
	// HashSeed is PYTHONHASHSEED ("" unset). Unset, sha256 uses a fixed
	// default seed (vLLM PR 51875, resolve_none_hash_seed) and xxhash a
	// random one per process.
	HashSeed string
	// HashAlgo is --prefix-caching-hash-algo: HashSHA256 (default; ""
	// means the same) or HashXXHash.
	HashAlgo string
	// P2P adds the peer secondary tier (TieringOffloadingSpec with
	// {"type": "p2p"}): the engine serves its CPU tier to peers at
	// P2PPort + rank on its side-channel host and pulls from the peer a
	// request's kv_transfer_params.remote_kv_source names.
	P2P bool
	// P2PPort is the peer tier's base port (0: DefaultP2PPort).
	P2PPort int
}

func (c CPUTier) enabled() bool { return c.Chunks > 0 }

func (c CPUTier) blocksPerChunk() int { return max(c.BlocksPerChunk, 1) }

func (c CPUTier) p2pPort() int {
	if c.P2PPort > 0 {
		return c.P2PPort
	}
	return DefaultP2PPort
}

func (c CPUTier) algo() string {
	if c.HashAlgo == "" {
		return HashSHA256
	}
	return c.HashAlgo
}

// cpuChunk is one stored chunk: the KV of its tokens.
type cpuChunk struct {
	key  uint64
	kv   []uint64
	pins int           // loads in flight (ref_cnt > 0): not evictable
	elem *list.Element // position in the LRU list
}

// cpuTier is one rank's CPU tier (CPUOffloadingManager with the LRU
// policy). e.mu guards it.
type cpuTier struct {
	capacity int
	bs       int // GPU block size
	bpc      int // GPU blocks per chunk
	seed     uint64
	lru      *list.List // front: least recently used
	chunks   map[uint64]*cpuChunk

	stored, evicted, failures   int // chunks stored and evicted, failed store batches
	loadedLocal, loadedPeer     int // chunks loaded to the GPU from this tier, and of them promoted from a peer
	peerPulls, peerMisses       int // requests that asked a peer; of them those whose lookup ended on a miss
	peerRejects                 int // handshakes rejected (seed, block size or fingerprint mismatch)
	storeTokens, loadTokens     int // tokens moved GPU→CPU and CPU→GPU
	storeSeconds, loadSeconds   float64
	servedChunks, servedLookups int // as a source: chunks a peer fetched, lookups it answered
}

// newCPUTier makes a rank's tier; seed is the process's NONE_HASH seed.
func newCPUTier(c CPUTier, bs int, seed uint64) *cpuTier {
	return &cpuTier{capacity: c.Chunks, bs: bs, bpc: c.blocksPerChunk(), seed: seed,
		lru: list.New(), chunks: map[uint64]*cpuChunk{}}
}

// noneHashSeed is the process's NONE_HASH seed: PYTHONHASHSEED when set,
// else sha256's fixed default, else (xxhash) random per process.
func noneHashSeed(c CPUTier) uint64 {
	h := fnv.New64a()
	switch {
	case c.HashSeed != "":
		_, _ = h.Write([]byte("seed:" + c.HashSeed))
	case c.algo() == HashSHA256:
		_, _ = h.Write([]byte("default"))
	default:
		return randUint()
	}
	return splitmix(h.Sum64())
}

// chunkTokens is a chunk's size in tokens.
func (c *cpuTier) chunkTokens() int { return c.bs * c.bpc }

// keys returns the key of every whole chunk of toks: the chained block
// hash of each chunk's last GPU block. algo and salt enter the chain as
// NONE_HASH and the first block's extra keys do.
func (c *cpuTier) keys(toks []uint32, algo, salt string) []uint64 {
	h := c.seed
	if algo == HashXXHash {
		h = splitmix(h ^ 0x78786873)
	}
	if salt != "" {
		f := fnv.New64a()
		_, _ = f.Write([]byte(salt))
		h = splitmix(h ^ f.Sum64())
	}
	ct := c.chunkTokens()
	out := make([]uint64, 0, len(toks)/ct)
	for i := 0; i+c.bs <= len(toks); i += c.bs {
		for _, t := range toks[i : i+c.bs] {
			h = splitmix(h ^ uint64(t)*0xff51afd7ed558ccd)
		}
		h = splitmix(h ^ uint64(c.bs)) // a block boundary: other block sizes chain otherwise
		if (i+c.bs)%ct == 0 {
			out = append(out, h)
		}
	}
	return out
}

// has reports whether key is stored (a lookup; loads of keys being
// stored are not modelled: stores complete at once).
func (c *cpuTier) has(key uint64) bool { _, ok := c.chunks[key]; return ok }

// touch marks keys used, walking them in reverse (LRUCachePolicy.touch):
// the first ends most recent, so a request's tail is evicted first.
func (c *cpuTier) touch(keys []uint64) {
	for i := len(keys) - 1; i >= 0; i-- {
		if ch, ok := c.chunks[keys[i]]; ok {
			c.lru.MoveToBack(ch.elem)
		}
	}
}

// store writes chunks (keys[i] holds data[i]) as prepare_store and
// complete_store do: keys already stored are skipped; room is made by
// evicting least recently used chunks that are neither pinned nor in the
// batch; when not enough can be evicted nothing is stored and it reports
// false (the caller counts an allocation failure). Then every key of the
// request (all) is touched. It returns the tokens written.
func (c *cpuTier) store(keys []uint64, data [][]uint64, all []uint64) (int, bool) {
	var fresh []int
	for i, k := range keys {
		if !c.has(k) && !slicesContains(keys[:i], k) {
			fresh = append(fresh, i)
		}
	}
	if len(fresh) == 0 {
		return 0, true
	}
	over := len(c.chunks) + len(fresh) - c.capacity
	var victims []*cpuChunk
	for el := c.lru.Front(); el != nil && len(victims) < over; el = el.Next() {
		ch := el.Value.(*cpuChunk)
		if ch.pins == 0 && !slicesContains(keys, ch.key) {
			victims = append(victims, ch)
		}
	}
	if len(victims) < over {
		return 0, false
	}
	for _, ch := range victims {
		c.lru.Remove(ch.elem)
		delete(c.chunks, ch.key)
		c.evicted++
	}
	tokens := 0
	for _, i := range fresh {
		ch := &cpuChunk{key: keys[i], kv: data[i]}
		ch.elem = c.lru.PushBack(ch)
		c.chunks[ch.key] = ch
		tokens += len(data[i])
	}
	c.touch(all)
	return tokens, true
}

// pinned is the number of chunks pinned by loads in flight.
func (c *cpuTier) pinned() int {
	n := 0
	for _, ch := range c.chunks {
		if ch.pins > 0 {
			n++
		}
	}
	return n
}

func slicesContains(s []uint64, v uint64) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

// tierFilter is kv_load_tiers (_parse_tier_filter, TierMatcher): nil
// means every tier; an empty non-nil filter no secondary tier.
type tierFilter []tierMatch

type tierMatch struct{ medium, locality string } // "" matches anything

// allows reports whether the peer tier (medium CPU, assumed; locality
// dynamic: a tier declaring no locality passes every locality) takes part.
// The local CPU tier is never filtered (TieringOffloadingManager.lookup).
func (f tierFilter) allowsPeer() bool {
	if f == nil {
		return true
	}
	for _, m := range f {
		if m.medium == "" || m.medium == "cpu" {
			return true
		}
	}
	return false
}

// parseTierFilter reads kv_load_tiers: absent, not a list, or a list of
// only invalid entries: every tier (nil); [] none; else the valid entries
// (medium cpu|storage, locality local|remote, case-insensitive).
func parseTierFilter(raw []any, present, isList bool) tierFilter {
	if !present || !isList {
		return nil
	}
	if len(raw) == 0 {
		return tierFilter{}
	}
	var out tierFilter
	for _, v := range raw {
		m, ok := v.(map[string]any)
		if !ok {
			continue
		}
		var tm tierMatch
		valid := true
		if s, ok := m["medium"].(string); ok {
			tm.medium = strings.ToLower(s)
			valid = tm.medium == "cpu" || tm.medium == "storage"
		}
		if s, ok := m["locality"].(string); ok {
			tm.locality = strings.ToLower(s)
			valid = valid && (tm.locality == "local" || tm.locality == "remote")
		}
		if valid {
			out = append(out, tm)
		}
	}
	if len(out) == 0 {
		return nil
	}
	return out
}
