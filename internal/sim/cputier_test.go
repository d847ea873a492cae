package sim_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// tiered starts an engine with a CPU tier of chunks chunks (16-token
// blocks, one block a chunk) and its peer tier. GPU prefix caching is
// off unless gpuCache, so a repeated prompt can only hit the CPU tier.
func tiered(t *testing.T, reg *sim.Registry, chunks int, gpuCache bool, mod func(*sim.Config)) *node {
	t.Helper()
	return start(t, reg, nil, func(c *sim.Config) {
		c.CPUTier = sim.CPUTier{Chunks: chunks, P2P: true}
		c.PrefixCaching = gpuCache
		if mod != nil {
			mod(c)
		}
	})
}

func promptToks(t *testing.T, body any) []uint32 {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := sim.ParseRequest("/v1/chat/completions", raw)
	require.NoError(t, err)
	out := make([]uint32, len(req.Prompt))
	for i, tk := range req.Prompt {
		out[i] = tk.ID
	}
	return out
}

// source names n's peer tier as remote_kv_source.
func source(t *testing.T, n *node) map[string]any {
	t.Helper()
	host, port, ok := n.RankP2PAddr(0)
	require.True(t, ok)
	return map[string]any{"remote_kv_source": map[string]any{"kv_request_id": "xfer-1", "remote_host": host, "remote_port": port}}
}

// checkAnswer requires res to be the single-engine reference answer.
func checkAnswer(t *testing.T, n *node, body map[string]any, res result) {
	t.Helper()
	require.Equal(t, http.StatusOK, res.Status, string(res.Body))
	require.Equal(t, reference(t, "/v1/chat/completions", body).Content, res.Text)
	require.Zero(t, n.Stats().WrongOutputs)
}

// Write-through stores every whole chunk as it is computed: with
// offload_prompt_only (the default) the prompt's, with it false the
// generated ones too; a partial last chunk never leaves the GPU
// (OffloadingConnectorScheduler._build_store_jobs,
// _calc_num_offloadable_tokens, RequestOffloadState.storable_chunks).
func TestCPUTierWriteThrough(t *testing.T) {
	body := chat(msg{"user", words("write", 70)})
	prompt := tiered(t, sim.NewRegistry(), 256, true, nil)
	res := post(t, prompt.url, "/v1/chat/completions", body)
	checkAnswer(t, prompt, body, res)
	require.NotZero(t, res.Prompt%16, "the test needs a partial last chunk")
	require.Equal(t, res.Prompt/16, prompt.Stats().CPUChunksStored, "prompt chunks only, the partial one stays")

	gen := tiered(t, sim.NewRegistry(), 256, true, func(c *sim.Config) { c.CPUTier.OffloadGenerated = true })
	res = post(t, gen.url, "/v1/chat/completions", body)
	checkAnswer(t, gen, body, res)
	// the KV of every position but the last sampled token was computed
	computed := res.Prompt + res.Complete - 1
	require.Greater(t, computed/16, res.Prompt/16, "the reply must fill a chunk")
	require.Equal(t, computed/16, gen.Stats().CPUChunksStored)

	// the same prompt again is deduplicated by key: nothing new stored
	post(t, prompt.url, "/v1/chat/completions", body)
	require.Equal(t, res.Prompt/16, prompt.Stats().CPUChunksStored)
}

// A full tier whose chunks cannot be evicted skips the store and counts
// vllm:kv_offload_allocation_failure (prepare_store returns None); the
// request is served all the same.
func TestCPUTierFullSkipsStore(t *testing.T) {
	n := tiered(t, sim.NewRegistry(), 2, true, nil)
	body := chat(msg{"user", words("full", 70)})
	res := post(t, n.url, "/v1/chat/completions", body)
	checkAnswer(t, n, body, res)
	s := n.Stats()
	require.Zero(t, s.CPUChunksStored, "a batch larger than the tier stores nothing")
	// the stored index does not advance: the batch is tried (and
	// counted) again after later computed batches
	require.GreaterOrEqual(t, s.CPUStoreFailures, 1)
	require.Contains(t, metricsPage(t, n),
		fmt.Sprintf("vllm:kv_offload_allocation_failure_total{model_name=\"sim-model\",engine=\"0\"} %d.0", s.CPUStoreFailures))
}

// A later request reloads, after its GPU prefix-cache hit, the longest
// run of consecutive CPU hits in whole chunks, ending at the first miss
// (get_num_new_matched_tokens → _lookup → _maximal_prefix_lookup); the
// loaded blocks count as computed and the answer is the reference's.
func TestCPUTierLocalReloadStopsAtFirstMiss(t *testing.T) {
	n := tiered(t, sim.NewRegistry(), 256, false, func(c *sim.Config) {
		c.Profile = sim.Profile{HostToDevicePerToken: 1000}
	})
	body := chat(msg{"user", words("reload", 90)})
	res := post(t, n.url, "/v1/chat/completions", body)
	checkAnswer(t, n, body, res)
	whole := res.Prompt / 16 * 16

	res = post(t, n.url, "/v1/chat/completions", body)
	checkAnswer(t, n, body, res)
	rec := lastRecord(n)
	require.Equal(t, whole, rec.TierTokens)
	require.Equal(t, res.Prompt-whole, rec.ComputedTokens)
	require.Equal(t, int64(whole)*1000, int64(rec.Transfer), "host-to-device priced")

	require.True(t, n.DropCPUChunk(promptToks(t, body), 2))
	res = post(t, n.url, "/v1/chat/completions", body)
	checkAnswer(t, n, body, res)
	rec = lastRecord(n)
	require.Equal(t, 32, rec.TierTokens, "chunks 0 and 1; the miss at chunk 2 ends the hit though 3… are held")
	require.Equal(t, res.Prompt-32, rec.ComputedTokens)
}

// remote_kv_source makes the engine look the prompt's chunk keys up on
// the named peer's CPU tier; hits up to the first miss are promoted into
// its own tier and loaded as prefix-cache hits, the rest computed
// (P2PSecondaryTierManager; ServerRole._process_inbound_lookup;
// _maximal_prefix_lookup stops at the first MISS). A prompt sharing only
// a prefix with what the peer holds reuses only the shared chunks: keys
// include the tokens, so no wrong KV can attach.
func TestCPUTierPeerPull(t *testing.T) {
	reg := sim.NewRegistry()
	src := tiered(t, reg, 256, true, nil)
	dst := tiered(t, reg, 256, true, func(c *sim.Config) {
		c.Profile = sim.Profile{PeerFixed: 5000, PeerPerToken: 10, HostToDevicePerToken: 1}
	})
	shared := words("shared", 60)
	first := chat(msg{"user", shared + words(" first", 40)})
	checkAnswer(t, src, first, post(t, src.url, "/v1/chat/completions", first))

	// a different prompt with the same prefix: only the shared chunks
	second := chat(msg{"user", shared + words(" second", 40)})
	a, b := promptToks(t, first), promptToks(t, second)
	common := 0
	for common < min(len(a), len(b)) && a[common] == b[common] {
		common++
	}
	require.Greater(t, common/16, 1)
	require.Less(t, common/16, len(b)/16-1, "whole chunks after the shared prefix")
	res := post(t, dst.url, "/v1/chat/completions", with(second, "kv_transfer_params", source(t, src)))
	checkAnswer(t, dst, second, res)
	rec := lastRecord(dst)
	require.Equal(t, common/16*16, rec.PeerTokens)
	require.Equal(t, common/16*16, rec.TierTokens)
	require.Equal(t, int64(5000+10*rec.PeerTokens+rec.TierTokens), int64(rec.Transfer), "network + host-to-device")
	s := dst.Stats()
	require.Equal(t, common/16, s.CPUChunksFromPeer)
	require.Equal(t, 1, s.CPUPeerMisses, "the first differing chunk is a miss")
	require.Equal(t, common/16, src.Stats().CPUChunksServed)

	// a missing middle chunk on the peer ends the pull there
	third := chat(msg{"user", words("third", 100)})
	checkAnswer(t, src, third, post(t, src.url, "/v1/chat/completions", third))
	require.True(t, src.DropCPUChunk(promptToks(t, third), 3))
	res = post(t, dst.url, "/v1/chat/completions", with(third, "kv_transfer_params", source(t, src)))
	checkAnswer(t, dst, third, res)
	require.Equal(t, 48, lastRecord(dst).PeerTokens, "chunks 0 to 2, not those after the hole")
	require.Equal(t, 2, dst.Stats().CPUPeerMisses)
}

// The peer session's handshake compares block_len, the configuration
// fingerprint (model, block size, parallel layout) and the hash seed; a
// mismatch rejects the peer and every lookup misses: the request
// recomputes, no error reaches the client (P2PSession._on_connect).
func TestCPUTierPeerHandshakeMismatchRecomputes(t *testing.T) {
	for name, mod := range map[string]func(*sim.Config){
		"hash seed":       func(c *sim.Config) { c.CPUTier.HashSeed = "7" },
		"block size":      func(c *sim.Config) { c.BlockSize = 32 },
		"chunk size":      func(c *sim.Config) { c.CPUTier.BlocksPerChunk = 2 },
		"tensor parallel": func(c *sim.Config) { c.TPSize = 2 },
	} {
		t.Run(name, func(t *testing.T) {
			reg := sim.NewRegistry()
			src := tiered(t, reg, 256, true, mod)
			dst := tiered(t, reg, 256, true, func(c *sim.Config) { c.Profile = sim.Profile{PeerLookup: 3000} })
			body := chat(msg{"user", words("mismatch", 80)})
			checkAnswer(t, src, body, post(t, src.url, "/v1/chat/completions", body))
			res := post(t, dst.url, "/v1/chat/completions", with(body, "kv_transfer_params", source(t, src)))
			checkAnswer(t, dst, body, res)
			rec := lastRecord(dst)
			require.Zero(t, rec.TierTokens)
			require.Equal(t, res.Prompt, rec.ComputedTokens)
			require.EqualValues(t, 3000, rec.Transfer, "the lookup that found nothing costs its round trip")
			s := dst.Stats()
			require.Equal(t, 1, s.CPUPeerRejects)
			require.Equal(t, 1, s.CPUPeerMisses)
		})
	}
}

// kv_load_tiers filters the secondary tiers only: [] or a storage-only
// filter skips the peer, while the local CPU tier is always consulted
// (_parse_tier_filter, TieringOffloadingManager.lookup). A
// remote_kv_source missing a field is ignored (_parse_source).
func TestCPUTierLoadTiersFilter(t *testing.T) {
	reg := sim.NewRegistry()
	src := tiered(t, reg, 256, true, nil)
	dst := tiered(t, reg, 256, false, nil)
	body := chat(msg{"user", words("filter", 80)})
	checkAnswer(t, src, body, post(t, src.url, "/v1/chat/completions", body))
	params := func(tiers any) map[string]any {
		p := source(t, src)
		p["kv_load_tiers"] = tiers
		return with(body, "kv_transfer_params", p)
	}
	for _, tiers := range []any{[]any{}, []any{map[string]any{"medium": "storage"}}} {
		res := post(t, dst.url, "/v1/chat/completions", params(tiers))
		checkAnswer(t, dst, body, res)
		require.Zero(t, lastRecord(dst).PeerTokens)
	}
	require.Zero(t, dst.Stats().CPUPeerPulls)
	// the local tier now holds the prompt (written through): [] still loads it
	res := post(t, dst.url, "/v1/chat/completions", params([]any{}))
	checkAnswer(t, dst, body, res)
	require.Equal(t, res.Prompt/16*16, lastRecord(dst).TierTokens)

	// a locality filter passes the peer tier (its locality is dynamic)
	fresh := tiered(t, reg, 256, false, nil)
	res = post(t, fresh.url, "/v1/chat/completions", params([]any{map[string]any{"locality": "local"}}))
	checkAnswer(t, fresh, body, res)
	require.Equal(t, res.Prompt/16*16, lastRecord(fresh).PeerTokens)

	// no kv_request_id: the sub-dict is ignored
	bad := source(t, src)
	delete(bad["remote_kv_source"].(map[string]any), "kv_request_id")
	other := tiered(t, reg, 256, false, nil)
	checkAnswer(t, other, body, post(t, other.url, "/v1/chat/completions", with(body, "kv_transfer_params", bad)))
	require.Zero(t, other.Stats().CPUPeerPulls)
	require.Zero(t, lastRecord(other).TierTokens)
}

func metricsPage(t *testing.T, n *node) string { t.Helper(); return getBody(t, n.url+"/metrics") }

// /metrics carries the vllm:kv_offload_* series of offloading/metrics.py
// and CPUOffloadingMetrics; cpu_cache_usage_perc is the pinned fraction,
// not residency (get_stats), so a full idle tier reads 0; no capacity
// series (vllm:kv_offload_config_info is an open PR). An engine without a
// tier exports none of them.
func TestCPUTierMetrics(t *testing.T) {
	n := tiered(t, sim.NewRegistry(), 4, true, func(c *sim.Config) { c.Profile = sim.Profile{KVBytesPerToken: 2} })
	body := chat(msg{"user", words("m", 30)})
	res := post(t, n.url, "/v1/chat/completions", body)
	checkAnswer(t, n, body, res)
	page := metricsPage(t, n)
	for _, name := range []string{"vllm:kv_offload_store_bytes_total", "vllm:kv_offload_load_bytes_total",
		"vllm:kv_offload_store_time_total", "vllm:kv_offload_load_time_total", "vllm:kv_offload_allocation_failure_total",
		"vllm:kv_offload_cpu_cache_usage_perc", "vllm:kv_offload_cpu_cache_write_usage_perc",
		"vllm:kv_offload_cpu_cache_read_usage_perc"} {
		require.Contains(t, page, "# TYPE "+name+" ")
	}
	stored := n.Stats().CPUChunksStored
	require.NotZero(t, stored)
	require.Contains(t, page, fmt.Sprintf("vllm:kv_offload_store_bytes_total{model_name=\"sim-model\",engine=\"0\"} %d.0", stored*16*2))
	require.Contains(t, page, "vllm:kv_offload_cpu_cache_usage_perc{model_name=\"sim-model\",engine=\"0\"} 0.0")
	require.NotContains(t, page, "kv_offload_config_info")
	require.NotContains(t, page, "cpu_num_chunks")

	plain := start(t, sim.NewRegistry(), nil, nil)
	require.NotContains(t, metricsPage(t, plain), "vllm:kv_offload_")
}

// MultiConnector(NixlConnector, OffloadingConnector) lets the first child
// with a positive count load a request alone (MultiConnector.
// get_num_new_matched_tokens): a decode leg carrying P's handle reads from
// P by NIXL even when D's own CPU tier holds the prompt.
func TestCPUTierNIXLLoadsFirst(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := tiered(t, reg, 256, false, nil)
	body := chat(msg{"user", words("nixl", 90)})
	checkAnswer(t, d, body, post(t, d.url, "/v1/chat/completions", body)) // D's tier holds the prompt
	rp := post(t, p.url, "/v1/chat/completions", with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
	rd := post(t, d.url, "/v1/chat/completions", with(body, "kv_transfer_params", rp.KV))
	checkAnswer(t, d, body, rd)
	rec := lastRecord(d)
	require.Equal(t, sim.PullRead, rec.Pull)
	require.Zero(t, rec.TierTokens, "NIXL answered first: the CPU tier does not load")
	require.Equal(t, rd.Prompt, rec.PulledTokens)
}

// Engines in separate processes pull over the HTTP stand-in of the peer
// tier (RankP2PHandler and HTTPDialer): the same pull, the same answer.
func TestCPUTierPeerPullOverHTTP(t *testing.T) {
	var srcEngine *sim.Engine
	p2p := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		sim.RankP2PHandler(srcEngine, 0).ServeHTTP(w, r)
	}))
	t.Cleanup(p2p.Close)
	u, err := url.Parse(p2p.URL)
	require.NoError(t, err)
	port, err := strconv.Atoi(u.Port())
	require.NoError(t, err)
	src := tiered(t, sim.NewRegistry(), 256, true, func(c *sim.Config) {
		c.SideHost, c.SidePort, c.CPUTier.P2PPort = "127.0.0.1", 1, port
	})
	srcEngine = src.Engine
	reg := sim.NewRegistry()
	reg.Dial = sim.HTTPDialer(http.DefaultClient)
	dst := tiered(t, reg, 256, true, nil)

	body := chat(msg{"user", words("http", 80)})
	res := post(t, src.url, "/v1/chat/completions", body)
	checkAnswer(t, src, body, res)
	res = post(t, dst.url, "/v1/chat/completions", with(body, "kv_transfer_params", source(t, src)))
	checkAnswer(t, dst, body, res)
	require.Equal(t, res.Prompt/16*16, lastRecord(dst).PeerTokens)
	require.Zero(t, dst.Stats().CPUPeerMisses)
}
