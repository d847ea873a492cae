package sim

import (
	"testing"

	"github.com/stretchr/testify/require"
)

func tierFor(capacity int) *cpuTier {
	return newCPUTier(CPUTier{Chunks: capacity}, 4, noneHashSeed(CPUTier{}))
}

func kvs(n int) [][]uint64 {
	out := make([][]uint64, n)
	for i := range out {
		out[i] = make([]uint64, 4)
	}
	return out
}

// vLLM's LRUCachePolicy.touch walks a request's keys in reverse, so the
// first chunk ends most recent: a full tier evicts the request's tail
// before its head (cpu/policies/lru.py; CPUOffloadingManager.prepare_store
// evicts the least recently used).
func TestCPUTierEvictsLRUTailFirst(t *testing.T) {
	c := tierFor(4)
	a := []uint64{10, 11, 12, 13}
	_, ok := c.store(a, kvs(4), a)
	require.True(t, ok)
	b := []uint64{20}
	_, ok = c.store(b, kvs(1), b)
	require.True(t, ok)
	require.False(t, c.has(13), "the tail of the earlier request goes first")
	require.True(t, c.has(10) && c.has(11) && c.has(12))
	// a lookup of a's keys touches them: b's chunk is now the oldest
	c.touch(a[:3])
	_, ok = c.store([]uint64{30}, kvs(1), []uint64{30})
	require.True(t, ok)
	require.False(t, c.has(20))
	require.True(t, c.has(10) && c.has(12), "a's head and middle stay")
	require.Equal(t, 2, c.evicted)
}

// A chunk read by a load in flight (ref_cnt > 0) is not evictable, nor
// are the keys of the batch being stored; when no room can be made
// prepare_store returns None and nothing of the batch is stored
// (CPUOffloadingManager.prepare_store; the scheduler counts
// vllm:kv_offload_allocation_failure).
func TestCPUTierFullOfPinnedSkipsStore(t *testing.T) {
	c := tierFor(2)
	a := []uint64{1, 2}
	_, ok := c.store(a, kvs(2), a)
	require.True(t, ok)
	c.chunks[1].pins++
	c.chunks[2].pins++
	n, ok := c.store([]uint64{3}, kvs(1), nil)
	require.False(t, ok)
	require.Zero(t, n)
	require.False(t, c.has(3))
	require.True(t, c.has(1) && c.has(2))
	require.Equal(t, 1.0, float64(c.pinned())/float64(c.capacity), "usage is the pinned fraction")

	c.chunks[2].pins--
	_, ok = c.store([]uint64{3}, kvs(1), nil)
	require.True(t, ok, "an unpinned chunk makes room")
	require.True(t, c.has(1) && c.has(3))
	require.False(t, c.has(2))

	// a batch larger than what can be evicted stores none of its chunks
	c.chunks[1].pins--
	_, ok = c.store([]uint64{4, 5, 6}, kvs(3), nil)
	require.False(t, ok)
	require.False(t, c.has(4) || c.has(5) || c.has(6))
	// keys already stored are skipped (deduplicated), not rewritten
	n, ok = c.store([]uint64{1, 3}, kvs(2), nil)
	require.True(t, ok)
	require.Zero(t, n)
}

// Offload keys are prefix-cache block hashes taken at every
// hashes_per_chunk-th block (RequestOffloadState.update_offload_keys):
// chained over NONE_HASH (the hash seed and algorithm: init_none_hash),
// the GPU block size and the tokens, with cache_salt as the first
// block's extra key. Two tiers agree only when all of them match.
func TestCPUTierKeysAgreeOnlyWhenEverythingMatches(t *testing.T) {
	toks := make([]uint32, 64)
	for i := range toks {
		toks[i] = uint32(i * 7)
	}
	mk := func(c CPUTier, bs int) *cpuTier { return newCPUTier(c, bs, noneHashSeed(c)) }
	base := mk(CPUTier{Chunks: 8}, 16).keys(toks, HashSHA256, "")
	require.Len(t, base, 4)
	require.Equal(t, base, mk(CPUTier{Chunks: 8}, 16).keys(toks, HashSHA256, ""),
		"sha256 without PYTHONHASHSEED has a fixed default seed (PR 51875)")
	require.Equal(t, base[:2], mk(CPUTier{Chunks: 8}, 16).keys(toks[:40], HashSHA256, ""),
		"a prefix's keys are the prefix of the keys; a partial chunk has none")
	differ := func(name string, got []uint64) {
		t.Helper()
		for i := range got {
			require.NotEqual(t, base[min(i, len(base)-1)], got[i], "%s: chunk %d", name, i)
		}
	}
	differ("seed", mk(CPUTier{Chunks: 8, HashSeed: "42"}, 16).keys(toks, HashSHA256, ""))
	differ("algo", mk(CPUTier{Chunks: 8}, 16).keys(toks, HashXXHash, ""))
	differ("salt", mk(CPUTier{Chunks: 8}, 16).keys(toks, HashSHA256, "tenant-a"))
	differ("block size", mk(CPUTier{Chunks: 8}, 32).keys(toks, HashSHA256, ""))
	x1 := mk(CPUTier{Chunks: 8, HashAlgo: HashXXHash}, 16)
	x2 := mk(CPUTier{Chunks: 8, HashAlgo: HashXXHash}, 16)
	require.NotEqual(t, x1.seed, x2.seed, "xxhash without PYTHONHASHSEED: a random seed per process")
	// a chunk of two blocks is keyed by its last block's hash
	two := mk(CPUTier{Chunks: 8, BlocksPerChunk: 2}, 16).keys(toks, HashSHA256, "")
	one := mk(CPUTier{Chunks: 8}, 16).keys(toks, HashSHA256, "")
	require.Equal(t, []uint64{one[1], one[3]}, two)
}

// kv_load_tiers (_parse_tier_filter, TierMatcher): absent, not a list or
// only invalid entries: every tier; []: no secondary tier; an omitted
// field matches anything; the peer tier declares no locality (dynamic),
// so any locality passes it.
func TestTierFilter(t *testing.T) {
	parse := func(v any) tierFilter {
		l, isList := v.([]any)
		return parseTierFilter(l, v != nil, isList)
	}
	require.True(t, parseTierFilter(nil, false, false).allowsPeer(), "absent")
	require.True(t, parse("cpu").allowsPeer(), "not a list")
	require.False(t, parse([]any{}).allowsPeer(), "[]")
	require.True(t, parse([]any{map[string]any{"medium": "bogus"}}).allowsPeer(), "only invalid entries")
	require.False(t, parse([]any{map[string]any{"medium": "STORAGE"}}).allowsPeer())
	require.True(t, parse([]any{map[string]any{"medium": "CPU", "locality": "remote"}}).allowsPeer())
	require.True(t, parse([]any{map[string]any{"locality": "local"}}).allowsPeer())
}
