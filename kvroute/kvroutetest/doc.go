// Package kvroutetest provides test helpers for kvroute, in the manner of
// net/http/httptest: simulated vLLM prefill and decode engines that speak the
// bidirectional KV protocol (and fail the way real ones fail), and TestStore,
// a conformance suite for Store implementations.
//
// # Engines
//
// NewEngine starts a simulated vLLM OpenAI server on 127.0.0.1. Like vLLM,
// an engine is a prefiller or a decoder per request, decided by the
// request's kv_transfer_params:
//
//   - none: plain serving, prefill and decode locally, no handle;
//   - do_remote_decode (P role): prefill, reading what it lacks from the D
//     handle if one is given (remote_engine_id, remote_request_id,
//     remote_host, remote_port present and remote_block_ids non-empty), and
//     on a normal finish (max_tokens or a stop; only max_tokens with
//     WithPrefillHandleOnLengthOnly) answer with a P handle and hold the
//     blocks for the lease (WithLeaseDuration);
//   - do_remote_prefill (D role): read P's blocks, decode, and on a normal
//     finish keep the blocks for decoder_kv_blocks_ttl and answer with a D
//     handle whose remote_blocks_expiry_time is on the engine's own
//     monotonic clock (an arbitrary offset, not Unix time).
//
// NewCluster starts several engines sharing one side-channel Registry, so
// they can read each other's blocks; engines in different registries cannot.
//
// An engine is by default the engine a bidirectional deployment runs: the
// NixlConnector with bidirectional_kv_xfer on (a test default: vLLM's is
// off, see WithBidirectional) and vLLM's defaults otherwise. The rules the
// simulator follows, each with the vLLM file and function it comes from,
// are listed in internal/sim's documentation.
//
// # The model
//
// Tokens come from a deterministic tokenizer and a ChatML-like chat template
// (<|im_start|>{role}\n{content}<|im_end|>\n per message, tools in a system
// preamble, <|im_start|>assistant\n as the generation prompt; see
// internal/sim/template.go). The KV value at each position is chained from the
// value held at the position before it, and each generated token is a
// function of the last KV value. So the answer depends on the KV the engine
// actually holds: a stale, double or mismatched read changes it, and
// Stats.WrongOutputs counts decode outputs that differ from Reference. The
// reply's text re-tokenizes to exactly the generated tokens, so a client that
// sends it back unchanged extends the previous sequence.
//
// # Token ids and rendering
//
// As current vLLM: return_token_ids: true (chat and completions) adds the
// rendered prompt's ids (prompt_token_ids) and every generated id of each
// choice (token_ids, a final <|im_end|> and tokens cut by a stop string
// included); in streams prompt_token_ids rides on the first chunk only and
// each chunk carries the token_ids it covers, one chunk per generated token.
// Without the flag the keys are present as null, as vLLM writes them. D's
// handle then satisfies remote_num_tokens == len(prompt_token_ids) +
// len(token_ids) - 1, its blocks holding (prompt_token_ids ++ token_ids)
// [:remote_num_tokens]. POST /v1/chat/completions/render and
// /v1/completions/render return vLLM's GenerateRequest (for completions a
// list of one) whose token_ids are exactly the prompt generation would use
// (WithRenderer, WithRenderRoutes); POST /tokenize applies vLLM's reduced
// field set (no documents, reasoning_effort, tool_choice, response_format).
// Reference returns the ids too (Answer.PromptTokenIDs, Answer.TokenIDs).
//
// # Templates, reasoning and drift
//
// WithTemplate("llama3") trims every message (and ends some replies with
// whitespace before <|eot_id|>); a Qwen3-style enable_thinking false puts an
// empty think block in the generation prompt that past turns do not render;
// WithReasoningParser(false) keeps "<think>…</think>\n\n" in the content;
// WithReasoningField picks "reasoning" (default) or "reasoning_content";
// WithContentFormat picks how text parts join; WithDriftRate splits a word
// into two tokens whose text re-tokenizes to one. Each makes the next turn's
// prompt differ from D's blocks in a way only token ids reveal.
//
// # Tool calls
//
// With tools, tool_choice auto (the default) makes a share of the replies
// (WithToolCallRate, half by default) end in a call of one of the
// request's tools, answered as vLLM answers it: chat finish_reason
// tool_calls, Messages stop_reason tool_use with a tool_use block, a
// Responses function_call item; tool_choice required always calls (vLLM's
// guided JSON list), a named one makes the text the tool's arguments
// (finish stop). The call is generated tokens: echoed back with its result,
// an auto call renders as exactly the tokens D holds. Reference returns the
// calls (Answer.ToolCalls).
//
// # Partial reads and KV groups
//
// A reader pulls count = min(remote_num_tokens, prompt) - local hit and takes
// the last len(local) blocks of every group of remote_block_ids
// (WithKVGroups). Lowering remote_num_tokens is exact only with every group
// cut from the front to ceil(R'/B) blocks; an uncut list reads the wrong
// blocks silently; a group shorter than what the reader allocates answers
// 500 and restarts the engine (Stats.AssertFailures). WithHybrid makes a
// hybrid model: a second group of sliding-window layers in larger blocks,
// whose lists hold only the window's tail, so they differ in length from
// the first's and cannot be cut. Pulled blocks are
// cached under the reader's token hashes, so a bad read shows later as
// Stats.PoisonedHits. WithDecodeRecompute makes kv_recompute_threshold guard
// D's pull too.
//
// # Rules
//
// The engines follow the wire protocol of the kvroute package
// documentation: the pull count min(remote_num_tokens,
// prompt) - local prefix hit with a strict < kv_recompute_threshold; handles
// are single-use (the reader notifies, the emitter frees; a second read gets
// whatever the blocks hold now); reads are positional (the remote block list
// is trimmed to its last blocks) and never compare tokens; P declines a read
// within 5 s of the D handle's expiry and then applies
// kv_load_failure_policy; P frees blocks not read within the lease; D frees
// at once when its request is aborted.
//
// # KV capacity
//
// Each data-parallel rank has a pool of WithNumBlocks blocks, managed as
// vLLM's v1 scheduler and KV cache manager do (internal/sim/sched.go):
// blocks held for a remote reader (P's for kv_lease_duration, D's for
// decoder_kv_blocks_ttl) count as used and are never evicted; freed blocks
// stay in the prefix cache and are evicted least recently used first; a
// request waits, first come first served, until its whole prompt fits
// (less its prefix-cache hit) and fewer than WithMaxNumSeqs run; a running
// request takes a block at each block boundary as it generates and, with
// none free, preempts the running request scheduled last (perhaps itself),
// which is freed, put at the front of the queue, and recomputes its prompt
// and generated tokens when let in again; nothing is admitted in the step
// of a preemption. A request loading KV from a remote takes no running
// slot; once read it waits for one ahead of the queue. Waiting and
// recomputation cost
// modelled time: RequestRecord.Queued, Requeued, Recompute, Preemptions
// and FirstToken; Stats.Running, Waiting, UsedBlocks, Queued, Preemptions.
// Compute is not shared between requests: only KV memory is contended.
// While a D request waits with a P handle, it renews P's lease with
// heartbeats, as vLLM's connector does.
//
// A hold ends early only when a P request carrying its handle is scheduled:
// it reads, or takes the notify-only path (remote_num_tokens 0, a count
// below kv_recompute_threshold, or a local prefix hit that covers it) and
// D frees the whole hold (Stats.NotifiedHolds, NotifiedBlocks). A read P
// declines near the expiry, a failed read, a P request given up while it
// waits or rejected with 4xx notify nobody: D holds to the TTL
// (Stats.TTLBlocks). A notification for a hold gone changes nothing
// (Stats.StaleNotifies). Profile.KVBytesPerToken and KVCapacityTokens give
// a real node's figures (WithNumBlocks(p.NumGPUBlocks(16))).
//
// GET /metrics has vLLM's names: vllm:num_requests_running,
// vllm:num_requests_waiting, vllm:kv_cache_usage_perc (or the older
// vllm:gpu_cache_usage_perc, WithUsageMetric), vllm:num_preemptions_total
// (labels model_name, engine) and vllm:cache_config_info (labels
// num_gpu_blocks, block_size, enable_prefix_caching, kv_cache_size_tokens
// and the rest of vLLM's CacheConfig), and process_start_time_seconds.
//
// # Capabilities
//
// An engine plays what the vLLM a user runs offers: GET /version
// (WithVersion; none: 404), the render routes (WithRenderer: 501,
// WithRenderRoutes: 404, as without --enable-scale-out), POST /tokenize
// (WithTokenize), stream handles (WithStreamHandles, PR #40186),
// kv_transfer_params on Responses and Messages (WithResponsesKV,
// WithMessagesKV; older engines ignore it), prefix caching
// (WithPrefixCaching) and the block size (WithBlockSize).
//
// # Responses and Messages
//
// POST /v1/responses (OpenAI's Responses API, PathResponses) and
// POST /v1/messages (Anthropic's Messages API, PathMessages) carry
// kv_transfer_params in the request and in the non-streaming body, as
// vLLM with PRs #37424 and #37535 does, and take the same P/D path as chat:
// roles, pulls, holds, handles, costs and faults. vLLM converts both to
// chat messages and renders them with the chat template, and so does the
// engine: a conversation sent as chat, responses or messages gives the
// same prompt tokens. The P leg is stream false with max_output_tokens 1
// (responses, whose status is then "incomplete") or max_tokens 1
// (messages). In a Responses stream only response.completed, which wraps
// the final response object, can carry the handle, and only with
// WithStreamHandles; Messages streams never do. Messages errors are
// Anthropic's {"type": "error", "error": {...}}; Responses has no response
// store, so previous_response_id answers 404 and store is ignored.
// Reference answers for both (Answer.Text, Answer.Reasoning).
//
// # Data-parallel ranks and the system fingerprint
//
// WithDPSize(n) puts n data-parallel ranks behind one URL, as vLLM's
// --data-parallel-size does: each rank has its own engine id ("<id>_dp<k>"),
// block pool, held handles and side-channel port (base + k), so a handle
// works only at the port of the rank that emitted it. X-data-parallel-rank
// pins a request to a rank (out of range: 400); otherwise ranks take turns.
// WithFingerprint makes responses carry vLLM's system_fingerprint (on the
// final message only, in streams).
//
// # The CPU tier
//
// WithCPUTier gives an engine vLLM's OffloadingConnector behind its
// NixlConnector (MultiConnector): whole chunks written through to an LRU
// CPU tier (prompt chunks only unless OffloadGenerated), reloaded after
// the GPU prefix-cache hit up to the first missing chunk, and with P2P
// pulled from the peer a request's kv_transfer_params.remote_kv_source
// names ({"kv_request_id", "remote_host", "remote_port"}: the peer's
// RankP2PChannel), unless its kv_load_tiers excludes the peer. A peer of
// another hash seed, block size, chunk, model or TP size is rejected and
// every chunk misses: the request recomputes, its answer still
// Reference's. RequestRecord.TierTokens and PeerTokens, the Stats CPU*
// counters and the vllm:kv_offload_* series on GET /metrics show it;
// docs/simulator.md lists the rules and their vLLM sources.
//
// # Hostile engines
//
// HostileEngine is a decode engine that answers with one of
// HostileAnswers: for each API, streaming and not, every malformed way of
// hiding a KV handle in an answer (kv_transfer_params spelled with escapes
// at every object of the answer, a handle's members spread elsewhere,
// duplicate keys, huge numbers, invalid UTF-8, compressed bodies with and
// without Content-Encoding, byte order marks and split data lines in
// streams, streams cut inside an event, headers and error bodies naming
// the handle). CheckLeak is the oracle: it decodes every JSON value a
// client receives, at every depth, and looks for handle member names and
// the handles' distinctive values (HostileSecrets). TestHostile runs them
// all through a router or proxy.
//
// # Faults and time
//
// FailNext, CutStreamAfter, Stall, Restart and Refuse inject faults (a
// restarted engine has a new process_start_time_seconds on GET /metrics and
// a new engine id, unless WithEngineID fixed it: then a handle issued
// before the restart reads whatever the new process holds in its block
// ids). A
// Profile models prefill, transfer and decode time (LookupProfile has
// profiles calibrated on published results); modelled durations are in
// RequestRecord, and WithSpeed or a VirtualClock make them pass. A
// VirtualClock passes them one request at a time (time is serial); an
// EventClock runs any number of concurrent requests in modelled time, each
// taking its own, contending for KV blocks at the modelled moments, and
// repeatably: the clock for a fleet of agent sessions (see EventClock).
//
// An Engine, a Cluster and a Registry are safe for concurrent use.
package kvroutetest
