// Package capability probes a vLLM engine for what bidirectional KV reuse
// needs of it and says, for each capability, whether it is present, absent
// or unknown, and why.
//
// Most engines a router meets are stock vLLM builds someone else started:
// the render routes may be off (current `vllm serve` registers them only
// with --enable-scale-out), chat streams carry no handle (vLLM PR #40186 is
// unmerged), Messages streams never do, prefix caching may be off on a
// decode engine. [Probe] asks one engine, within one deadline and with
// small bodies:
//
//   - GET /version: the vLLM version, and what it implies
//     (return_token_ids from v0.10.2, kv_transfer_params on /v1/responses
//     and /v1/messages from v0.19.0, bidirectional_kv_xfer from v0.21.0);
//   - GET /v1/models: the served model and max_model_len;
//   - GET /metrics: process_start_time_seconds and vllm:cache_config_info
//     (enable_prefix_caching, block_size, num_gpu_blocks,
//     kv_cache_size_tokens, one sample per data-parallel rank);
//   - POST /v1/chat/completions/render, /v1/completions/render,
//     /v1/responses/render and /v1/messages/render with a one-word prompt:
//     200 present, 404 route not registered (no --enable-scale-out), 501
//     no renderer;
//   - POST /tokenize with a one-word prompt.
//
// What a probe cannot observe (whether decode streams carry handles on
// chat and completions, whether bidirectional_kv_xfer is on) stays
// [Unknown] until it is learned from real turns ([Report.Learn]).
//
// A [Report] has a one-line [Report.Summary], a JSON form (its fields'
// tags) and [Report.Facts], every capability under a stable name in a
// fixed order, for logs, metrics and tables. [Report.Verification] says
// how each API's prompt can be verified by tokens on a prefill engine.
//
// The package does no I/O but Probe's requests, keeps no state and logs
// nothing: callers decide when to probe and what to do with the facts.
package capability
