// Command vllmsim runs one simulated vLLM engine as a process, so a proxy or
// any other client can be pointed at real processes. Its flags follow
// vLLM's, a prefill and a decode engine as docs/engines.md starts vLLM's:
//
//	vllmsim --port 8100 --side-channel-port 5600 --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}' [MODEL]
//	vllmsim --port 8200 --side-channel-port 5601 --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}' [MODEL]
//
// kv_role must be one of vLLM's (kv_producer, kv_consumer, kv_both) and is
// required with a kv_connector, as vLLM requires; like vLLM's NixlConnector,
// the simulator takes each request's role from its kv_transfer_params.
// vllmsim --help lists every flag by group. Other flags: --host (default 127.0.0.1), --model, --no-enable-prefix-caching,
// --block-size, --num-gpu-blocks-override (num_gpu_blocks, vLLM's null block
// included; default the profile's capacity on an 8xH200 node, else 8193),
// --max-num-seqs (default 1024), --tensor-parallel-size, --profile
// (qwen3-32b, glm-5-fp8), --speed, --stream-handles, --reasoning,
// --inline-reasoning, --reasoning-field (reasoning, reasoning_content, both),
// --drift-rate, --tool-call-rate (default 0.5), --kv-groups, --kv-group-block-size and
// --sliding-window (a hybrid model: the groups after the first hold
// sliding-window layers in larger blocks), --prefill-handle-on-length-only,
// --decode-recompute, --template (chatml, llama3), --chat-template-content-format (string,
// openai), --render-api (enabled, disabled, absent), --data-parallel-size
// (default 1), --strict-rank, --fingerprint-mode (full, hash, custom, none;
// default absent), --fingerprint-value, --side-channel-host, --verbose, and
// knobs for what an engine offers: --sim-version (GET /version; empty: 404),
// --no-tokenize (no POST /tokenize), --no-responses-kv-transfer and
// --no-messages-kv-transfer (engines before PRs #37424, #37535: the APIs
// ignore kv_transfer_params), --kv-usage-metric (current, legacy, both).
// --kv-transfer-config is read as vLLM reads it, with vLLM's defaults:
// without it the engine has no KV connector and ignores kv_transfer_params
// (no transfer, no handle); with it, kv_connector must be "NixlConnector"
// and kv_role is required; bidirectional_kv_xfer (default false),
// kv_recompute_threshold (default 64),
// decoder_kv_blocks_ttl (480) and kv_lease_duration (30) are read from
// kv_connector_extra_config only (at the top level they are ignored, with
// a warning on stderr), kv_load_failure_policy (default fail) and
// engine_id from the top level only. engine_id fixes the NIXL engine id
// (else a random one per start, as vLLM draws). So an engine started
// without bidirectional_kv_xfer true returns no handle from a decode, as
// vLLM does, and a router's doctor reports it. GET /metrics serves process_start_time_seconds and vLLM's
// vllm:num_requests_running, vllm:num_requests_waiting,
// vllm:kv_cache_usage_perc, vllm:num_preemptions_total and
// vllm:cache_config_info (num_gpu_blocks, block_size,
// enable_prefix_caching, kv_cache_size_tokens, ...), and GET /sim/stats
// returns the engine's counters as JSON. KV capacity is enforced as vLLM's
// scheduler does: requests wait for blocks first come first served, holds
// are pinned, and a running request that finds no free block preempts the
// one scheduled last.
//
// Besides POST /v1/chat/completions and /v1/completions it serves vLLM's
// POST /v1/responses (OpenAI's Responses API) and POST /v1/messages and
// /v1/messages/count_tokens (Anthropic's Messages API), rendered through
// the same chat template and taking the same P/D path, with
// kv_transfer_params in their requests and bodies; their render endpoints
// (/v1/responses/render, /v1/messages/render) follow --render-api.
//
// The engine serves vLLM's OpenAI API on --host:--port and its side channel
// (the stand-in for NIXL) over HTTP on --side-channel-host:--side-channel-port,
// the address it puts in its handles. Engines in other processes are read
// through their side channels. It prints one line when ready:
//
//	vllmsim: serving http://127.0.0.1:8100 side channel 127.0.0.1:5600 engine sim-...
//
// With --data-parallel-size n > 1, rank k serves its side channel on
// --side-channel-port + k and the line ends with
// " data-parallel n side ports P-Q"; the engine printed is rank 0's.
//
// With a MultiConnector --kv-transfer-config (NixlConnector, then
// OffloadingConnector) the engine has vLLM's CPU tier (docs/simulator.md):
// write-through of whole chunks, LRU eviction, reloads after the GPU
// prefix-cache hit, and with a "p2p" secondary tier pulls from the peer a
// request's kv_transfer_params.remote_kv_source names; it serves its own
// tier to peers over HTTP on --side-channel-host and the tier's port
// (+ rank), and the ready line ends with " p2p HOST:PORT". Chunk keys
// agree across engines only with one --block-size, chunk,
// --prefix-caching-hash-algo and PYTHONHASHSEED (read from the
// environment).
//
// With --canned prefill or --canned decode it simulates nothing: it answers
// at once with fixed bytes (and a toy tokenizer for render calls and
// return_token_ids), for router overhead runs only (examples/bench
// --overhead); its handles are the size vLLM's are (one block id per
// --block-size tokens of the prompt, and for D of the reply, in each of
// --kv-groups lists, ids below 100,000); it reports a pool of 100,000
// blocks, or --num-gpu-blocks-override (at least 100,000), as
// num_gpu_blocks; its ready line is "vllmsim: serving http://ADDR canned
// ROLE".
//
// It stops on SIGINT or SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	err := run(ctx, os.Args[1:], os.Stdout, os.Stderr)
	stop()
	switch {
	case errors.Is(err, flag.ErrHelp):
	case errors.Is(err, errUsage):
		fmt.Fprintln(os.Stderr, "vllmsim:", err)
		os.Exit(2)
	case err != nil:
		fmt.Fprintln(os.Stderr, "vllmsim:", err)
		os.Exit(1)
	}
}
