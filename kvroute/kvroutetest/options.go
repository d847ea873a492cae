package kvroutetest

import (
	"log/slog"
	"time"

	"github.com/bidikv/bidikv/internal/sim"
)

// Defaults of the engine options. They are those of a vLLM engine started
// as a bidirectional deployment needs it: --kv-transfer-config
// '{"kv_connector":"NixlConnector","kv_role":"kv_both",
// "kv_connector_extra_config":{"bidirectional_kv_xfer":true}}' and vLLM's
// defaults for the rest. Bidirectional transfer on is a test default: vLLM's
// own default is off (see WithBidirectional), and examples/vllmsim keeps
// vLLM's.
const (
	DefaultModel              = "sim-model"
	DefaultBlockSize          = 16
	DefaultNumBlocks          = 8192
	DefaultRecomputeThreshold = 64
	DefaultDecoderBlocksTTL   = 480 * time.Second
	DefaultLeaseDuration      = 30 * time.Second
	// DeclineWindow is how close to a D handle's expiry P declines a read.
	DeclineWindow = 5 * time.Second
)

// An Option configures an Engine.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	sim  sim.Config
	reg  *Registry
	side bool // side channel set explicitly
	// dpSet: WithDPSize was given (0 is then invalid, not the default)
	dpSet bool
	addr  string // HTTP listen address; "" is 127.0.0.1:0
}

func defaultConfig() config { return config{sim: sim.DefaultConfig()} }

// WithRegistry puts the engine's side channel in r, so engines in the same
// registry can read each other's blocks. Default: a private registry, which
// no other engine can reach (a read from it fails as an unreachable side
// channel does).
func WithRegistry(r *Registry) Option { return optionFunc(func(c *config) { c.reg = r }) }

// WithClock sets the clock behind leases, TTLs and handle expiry times.
// Default: real time. A clock with a Sleep(ctx, d) error method (such as
// *VirtualClock) also receives the modelled durations instead of sleeps;
// an *EventClock times them on its timers, so that concurrent requests
// take their modelled time and contend for KV blocks in it.
func WithClock(clk Clock) Option { return optionFunc(func(c *config) { c.sim.Clock = clk }) }

// WithModel sets the served model name (default "sim-model"). Requests naming
// another model get 404; the name also seeds the simulated model.
func WithModel(name string) Option { return optionFunc(func(c *config) { c.sim.Model = name }) }

// WithBlockSize sets the KV block size in tokens (default 16; must be >= 1).
func WithBlockSize(n int) Option { return optionFunc(func(c *config) { c.sim.BlockSize = n }) }

// WithNumBlocks sets the KV pool's capacity in usable blocks of each
// data-parallel rank (default 8192; must be >= 1; vllm:cache_config_info
// reports num_gpu_blocks n+1, counting vLLM's null block). As vLLM's
// scheduler: blocks held for a remote reader count as used and are never
// evicted; a request waits, first come first served, until its prompt
// fits; a running request takes a block each time it crosses a block
// boundary and, with none free, preempts the running request scheduled
// last (perhaps itself), which is recomputed when it is let in again.
// Waiting and recomputation cost modelled time (RequestRecord.Queued,
// Requeued, Recompute, FirstToken; Stats.Preemptions). A prompt that
// cannot fit in n×block size tokens (max_model_len) gets vLLM's 400.
// Profile.NumGPUBlocks gives a node's realistic capacity.
func WithNumBlocks(n int) Option { return optionFunc(func(c *config) { c.sim.NumBlocks = n }) }

// WithMaxModelLen sets --max-model-len: the most tokens one request may
// take, prompt and max_tokens together (default 0: the whole KV pool,
// WithNumBlocks × block size; more than that is invalid, as vLLM refuses
// to start when one such request does not fit). GET /v1/models lists it
// as max_model_len, and a request over it gets vLLM's 400.
func WithMaxModelLen(n int) Option { return optionFunc(func(c *config) { c.sim.MaxModelLen = n }) }

// WithMaxNumSeqs sets --max-num-seqs: at most n requests of a rank run at
// once, the others wait (default 1024, vLLM's on H200-class GPUs; 0 means
// no limit; negative is invalid). A request loading KV from a remote takes
// no slot; once read it waits for one, ahead of the waiting queue.
func WithMaxNumSeqs(n int) Option { return optionFunc(func(c *config) { c.sim.MaxNumSeqs = n }) }

// WithVersion sets what GET /version answers: {"version": v} (default
// DefaultVersion). An empty v makes the route answer 404, as a server
// without it.
func WithVersion(v string) Option { return optionFunc(func(c *config) { c.sim.Version = v }) }

// DefaultVersion is the vLLM version an engine reports on GET /version by
// default.
const DefaultVersion = sim.DefaultVersion

// WithTokenize(false) removes POST /tokenize (404 {"detail": "Not
// Found"}); default true.
func WithTokenize(on bool) Option { return optionFunc(func(c *config) { c.sim.NoTokenize = !on }) }

// WithResponsesKV(false) is an engine older than vLLM PR #37424: POST
// /v1/responses ignores kv_transfer_params (the request is served as a
// plain one: no read, no hold) and its response has no such key. Default
// true: accepted, and the handle returned in the body (and, with
// WithStreamHandles, on response.completed).
func WithResponsesKV(on bool) Option {
	return optionFunc(func(c *config) { c.sim.NoResponsesKV = !on })
}

// WithMessagesKV(false) is an engine older than vLLM PR #37535: POST
// /v1/messages ignores kv_transfer_params and returns none. Default true:
// accepted, and the handle returned in the non-streaming body.
func WithMessagesKV(on bool) Option { return optionFunc(func(c *config) { c.sim.NoMessagesKV = !on }) }

// Names of the KV usage gauge, for WithUsageMetric.
const (
	UsageMetricCurrent = sim.UsageMetricCurrent // vllm:kv_cache_usage_perc
	UsageMetricLegacy  = sim.UsageMetricLegacy  // vllm:gpu_cache_usage_perc (before vLLM 0.9)
	UsageMetricBoth    = sim.UsageMetricBoth    // both, as vLLM 0.9 and 0.10
)

// WithUsageMetric names the KV usage gauge on GET /metrics (default
// UsageMetricCurrent).
func WithUsageMetric(name string) Option {
	return optionFunc(func(c *config) { c.sim.UsageMetric = name })
}

// WithPrefixCaching turns prefix caching on (default) or off (vLLM's
// --no-enable-prefix-caching).
func WithPrefixCaching(on bool) Option {
	return optionFunc(func(c *config) { c.sim.PrefixCaching = on })
}

// WithStreamHandles chooses the stream behaviour: false (default) is stock
// vLLM, with no handle in any stream chunk; true is vLLM with PR #40186, a
// top-level kv_transfer_params on the final chunk.
func WithStreamHandles(on bool) Option {
	return optionFunc(func(c *config) { c.sim.StreamHandles = on })
}

// WithRecomputeThreshold sets kv_recompute_threshold (default 64, vLLM's
// with bidirectional transfer on; vLLM's default is 0 with it off, which
// WithBidirectional(false) does not change; 0 disables the check; negative
// is invalid): P recomputes instead of pulling when the count is strictly
// below it (and D too, with WithDecodeRecompute).
func WithRecomputeThreshold(n int) Option {
	return optionFunc(func(c *config) { c.sim.RecomputeThreshold = n })
}

// WithDecoderBlocksTTL sets decoder_kv_blocks_ttl (default 480 s; must be
// positive), how long D keeps its blocks after a normal finish.
func WithDecoderBlocksTTL(d time.Duration) Option {
	return optionFunc(func(c *config) { c.sim.DecoderBlocksTTL = d })
}

// WithKVLoadFailurePolicy sets kv_load_failure_policy: "fail" (default, the
// request ends with vLLM's 500 error) or "recompute" (computed locally).
func WithKVLoadFailurePolicy(p string) Option {
	return optionFunc(func(c *config) { c.sim.KVLoadFailurePolicy = p })
}

// WithLeaseDuration sets kv_lease_duration (default 30 s; must be positive),
// how long P holds blocks no decoder has read.
func WithLeaseDuration(d time.Duration) Option {
	return optionFunc(func(c *config) { c.sim.LeaseDuration = d })
}

// WithProfile sets the cost model (default: zero cost).
func WithProfile(p Profile) Option {
	return optionFunc(func(c *config) { c.sim.Profile = sim.Profile(p) })
}

// WithSpeed makes the engine sleep modelled/speed in real time (default 0:
// never sleep; negative is invalid). Sleeps end early when the client goes
// away.
func WithSpeed(f float64) Option { return optionFunc(func(c *config) { c.sim.Speed = f }) }

// WithTPSize sets the tp_size put in handles (default 1).
func WithTPSize(n int) Option { return optionFunc(func(c *config) { c.sim.TPSize = n }) }

// WithSideChannel sets the side-channel address put in handles (default: a
// synthetic address such as 10.0.0.1:5600 from the registry). It differs from
// the HTTP address, as VLLM_NIXL_SIDE_CHANNEL_HOST/PORT do.
func WithSideChannel(host string, port int) Option {
	return optionFunc(func(c *config) { c.sim.SideHost, c.sim.SidePort, c.side = host, port, true })
}

// WithReasoning makes replies start with reasoning (<think>…</think>\n\n),
// returned in the reasoning field (see WithReasoningField), which the chat
// template drops from past assistant turns as Qwen3's does (default false).
// A request with chat_template_kwargs {"enable_thinking": false} (or
// reasoning_effort "none") gets Qwen3's empty think block in its generation
// prompt and no reasoning.
func WithReasoning(on bool) Option { return optionFunc(func(c *config) { c.sim.Reasoning = on }) }

// WithLogger sets the logger (default: silent). Prompts and bodies are never
// logged.
func WithLogger(l *slog.Logger) Option { return optionFunc(func(c *config) { c.sim.Logger = l }) }

// WithBidirectional sets kv_connector_extra_config.bidirectional_kv_xfer
// (default true, a test default for the engines a router needs; vLLM's
// default, and examples/vllmsim's, is false). When false the engine is a
// stock one-way P/D engine: D emits no handle and frees its blocks when it
// finishes, and P ignores D handles (it neither reads nor notifies).
func WithBidirectional(on bool) Option {
	return optionFunc(func(c *config) { c.sim.Bidirectional = on })
}

// WithRenderer turns the render endpoints (POST /v1/chat/completions/render
// and POST /v1/completions/render) on (default) or off. Off, they answer as
// vLLM does without a renderer: 501 with vLLM's error JSON, type
// "NotImplementedError". WithRenderRoutes(false) takes precedence.
func WithRenderer(on bool) Option {
	return optionFunc(func(c *config) {
		switch {
		case c.sim.Render == sim.RenderAbsent:
		case on:
			c.sim.Render = sim.RenderEnabled
		default:
			c.sim.Render = sim.RenderDisabled
		}
	})
}

// WithRenderRoutes(false) makes the engine an older vLLM without the render
// API: the render paths do not exist and answer 404 {"detail":"Not Found"}
// (default true). POST /tokenize is served either way.
func WithRenderRoutes(on bool) Option {
	return optionFunc(func(c *config) {
		switch {
		case !on:
			c.sim.Render = sim.RenderAbsent
		case c.sim.Render == sim.RenderAbsent:
			c.sim.Render = sim.RenderEnabled
		}
	})
}

// WithReasoningParser(false) serves WithReasoning without a reasoning
// parser: the reply's content holds "<think>…</think>\n\n…" and the
// reasoning field is null; the template still strips the think block from
// past turns (default true).
func WithReasoningParser(on bool) Option {
	return optionFunc(func(c *config) { c.sim.InlineReasoning = !on })
}

// WithReasoningField names the reasoning key of chat messages and stream
// deltas: "reasoning" (default, current vLLM), "reasoning_content" (older
// engines) or "both".
func WithReasoningField(name string) Option {
	return optionFunc(func(c *config) { c.sim.ReasoningField = name })
}

// WithTemplate chooses the chat template family: "chatml" (default,
// Qwen3-like) or "llama3" (Llama-3-Instruct: header tokens, <|eot_id|>, every
// message's content trimmed; replies sometimes end with a whitespace token
// before EOS, so a reply sent back verbatim re-renders shorter).
func WithTemplate(name string) Option {
	return optionFunc(func(c *config) { c.sim.Template = name })
}

// WithContentFormat sets vLLM's chat template content format: "string"
// (default; text parts joined with "\n") or "openai" (parts passed as a list
// and concatenated by the template). A single text part renders like a
// string either way.
func WithContentFormat(format string) Option {
	return optionFunc(func(c *config) { c.sim.ContentFormat = format })
}

// WithDriftRate sets the probability per reply (0 to 1; default 0) that the
// sampler emits one content word as two tokens (" amber" as " am" + "ber")
// whose text re-tokenizes to one token, as BPE sampling can. It is decided
// from the KV, so Reference reproduces it; the next turn's prompt, holding
// the reply's text, then tokenizes differently from D's blocks.
func WithDriftRate(p float64) Option { return optionFunc(func(c *config) { c.sim.DriftRate = p }) }

// WithToolCallRate sets the probability per reply (0 to 1; default 0.5)
// that a chat, Responses or Messages reply under tool_choice auto (the
// default when tools are given) ends in a call of one of the request's
// tools, as a model served with vLLM's --enable-auto-tool-choice does:
// text, then "\n<tool_call>…</tool_call>", then EOS; the API answers it
// as vLLM does (chat finish_reason "tool_calls", Messages stop_reason
// "tool_use" with a tool_use block, Responses a function_call item). It
// is decided from the KV, so Reference reproduces it. tool_choice
// required always calls (the reply is the JSON list vLLM's guided
// decoding makes), a named tool_choice makes the generated text that
// tool's arguments, none never calls.
func WithToolCallRate(p float64) Option {
	return optionFunc(func(c *config) { c.sim.ToolCallRate = p })
}

// WithKVGroups sets the number of KV-cache groups (default 1), as an MLA or
// full-attention model with several groups has: handles carry one list of
// block ids per group, all of equal length, and a reader checks and reads
// every group. A group shorter than the blocks the reader allocates trips
// vLLM's worker assert (len(local) <= len(remote)): the request gets 500,
// Stats.AssertFailures counts it, and the engine restarts (new engine id,
// nothing held, no notification sent), as a dead worker's process would be.
func WithKVGroups(n int) Option { return optionFunc(func(c *config) { c.sim.KVGroups = n }) }

// WithHybrid makes a hybrid model, as vLLM runs one with full-attention and
// sliding-window layers: two KV-cache groups, the first of full attention
// at the block size (WithBlockSize; what vllm:cache_config_info reports),
// the second of sliding-window layers of window tokens in blocks of
// groupBlockSize tokens (a multiple of the block size: vLLM raises the
// block size of a group with smaller pages). A handle's second list holds
// only the window's tail (cdiv(window, groupBlockSize) + 1 ids), so the
// groups differ in length and a handle cannot be read in part; a reader
// reads each group's tail, and a list cut at the wrong end reads the
// wrong blocks (a wrong answer).
func WithHybrid(groupBlockSize, window int) Option {
	return optionFunc(func(c *config) {
		c.sim.KVGroups, c.sim.GroupBlockSize, c.sim.SlidingWindow = 2, groupBlockSize, window
	})
}

// WithPrefillHandleOnLengthOnly(true) is an older engine's P, which emits its
// handle only when the request stopped on max_tokens. Default false: as
// current vLLM, P emits it on any normal finish (length or a stop: EOS or a
// stop string).
func WithPrefillHandleOnLengthOnly(on bool) Option {
	return optionFunc(func(c *config) { c.sim.PrefillHandleOnLengthOnly = on })
}

// WithDecodeRecompute(true) makes kv_recompute_threshold guard D's pull as
// well as P's, as vLLM PR #55801 does: D computes the prompt locally instead of
// pulling fewer tokens than the threshold from P, and still notifies P (which
// frees its blocks). Default false, so that D always pulls what it lacks.
func WithDecodeRecompute(on bool) Option {
	return optionFunc(func(c *config) { c.sim.DecodeRecompute = on })
}

// WithDPSize sets --data-parallel-size (default 1; must be >= 1): n
// data-parallel ranks behind one HTTP address, each an engine core with its
// own NIXL engine id ("<id>_dp<k>" when n > 1, as vLLM names them), its own
// block pool (WithNumBlocks blocks each) and held handles, and its own side
// channel at the base port + k (WithSideChannel's port is rank 0's). A
// request's X-data-parallel-rank header (any case) pins it to rank k; a rank
// outside [0, n) answers vLLM's 400 (a streaming request gets a 200 stream
// whose one event is that error); without the header, or with a value
// Python's int() cannot parse, ranks take requests in turn. Stats sum over
// the ranks and RequestRecord.Rank tells which one served a request. With
// n = 1 the header is ignored (see WithStrictRank).
func WithDPSize(n int) Option {
	return optionFunc(func(c *config) { c.sim.DPSize, c.dpSet = n, true })
}

// WithPromptTokensDetails(true) is vLLM's --enable-prompt-tokens-details:
// chat and completions usage carries prompt_tokens_details.cached_tokens,
// the prompt tokens the engine did not compute (prefix-cache hits, pulled
// or loaded from a CPU tier). Default false, as vLLM's: null.
func WithPromptTokensDetails(on bool) Option {
	return optionFunc(func(c *config) { c.sim.PromptTokensDetails = on })
}

// WithStrictRank(true) makes a one-rank engine check X-data-parallel-rank as
// vLLM does: any rank but 0 answers 400. Default false: with WithDPSize(1)
// the header is ignored, so a router pinning ranks works against a one-rank
// engine.
func WithStrictRank(on bool) Option {
	return optionFunc(func(c *config) { c.sim.StrictRank = on })
}

// WithFingerprint sets the system_fingerprint, as vLLM's --fingerprint-mode
// and --fingerprint-value do: "full" (vLLM's default,
// "vllm-<version>[-tp<n>][-dp<n>]-<hash8>", the hash fixed by the
// configuration), "hash" ("vllm-<version>-<hash8>"), "custom" (value; null
// when empty) or "none" (null). Non-streaming chat and completions responses
// carry it (null included); in a stream only the final message does: every
// chunk with a finish_reason, or instead the usage chunk when
// stream_options.include_usage is set; a null fingerprint is left out of
// chunks. Default "absent": no system_fingerprint key anywhere, as engines
// before the fingerprint.
func WithFingerprint(mode, value string) Option {
	return optionFunc(func(c *config) { c.sim.Fingerprint, c.sim.FingerprintValue = mode, value })
}

// WithEngineID fixes the NIXL engine id put in handles, as
// kv_transfer_config's engine_id does (with WithDPSize, rank k's is id +
// "_dp<k>"): it then survives Restart, and a handle issued before the
// restart names blocks that now hold other content. Default: a random id
// at every start, as vLLM draws one.
func WithEngineID(id string) Option { return optionFunc(func(c *config) { c.sim.EngineID = id }) }

// CPUTier configures an engine's CPU tier: vLLM's OffloadingConnector
// behind the NixlConnector (MultiConnector, NIXL first), with its
// optional peer tier (TieringOffloadingSpec with a "p2p" secondary tier),
// as docs/cpu-tier.md describes them. The zero value is no tier.
type CPUTier struct {
	// Chunks is the capacity in chunks per data-parallel rank
	// (cpu_bytes_to_use over the bytes of one chunk); 0: no tier.
	Chunks int
	// BlocksPerChunk is the chunk in GPU blocks (the connector's
	// block_size over --block-size); 0 means 1.
	BlocksPerChunk int
	// OffloadGenerated is offload_prompt_only false: generated chunks
	// are written through too. false (vLLM's default): prompt chunks only.
	OffloadGenerated bool
	// HashSeed is PYTHONHASHSEED ("" unset: sha256 uses a fixed default
	// seed, xxhash a random one per process).
	HashSeed string
	// HashAlgo is --prefix-caching-hash-algo: "sha256" (default; "" means
	// the same) or "xxhash".
	HashAlgo string
	// P2P adds the peer tier: the engine serves its CPU tier at
	// RankP2PChannel and pulls from the peer a request's
	// kv_transfer_params.remote_kv_source names (engines in the same
	// Registry).
	P2P bool
	// P2PPort is the peer tier's base port (0: 5710,
	// VLLM_P2P_SIDE_CHANNEL_PORT's default).
	P2PPort int
}

// WithCPUTier gives the engine a CPU tier (default none). Whole chunks are
// written through as they are computed (prompt chunks only unless
// OffloadGenerated; a partial last chunk stays on the GPU), deduplicated
// by key, into an LRU that evicts a request's tail before its head and
// never a chunk being loaded; a batch that cannot be stored is skipped
// and counted (Stats.CPUStoreFailures, vllm:kv_offload_allocation_failure).
// A later request loads, after its GPU prefix-cache hit, the consecutive
// whole chunks the tier (then the peer named by remote_kv_source, unless
// kv_load_tiers excludes it) holds, up to the first miss, priced by the
// profile's HostToDevicePerToken and PeerFixed/PeerPerToken. A peer whose
// hash seed, block size, chunk, model or TP size differs is rejected:
// every lookup misses and the request recomputes. When the NixlConnector
// reads (a usable handle), it loads the request alone. Chunks < 0 is
// invalid.
func WithCPUTier(t CPUTier) Option {
	return optionFunc(func(c *config) { c.sim.CPUTier = sim.CPUTier(t) })
}
