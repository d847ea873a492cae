// Package sim is the engine behind kvroutetest and examples/vllmsim: a
// simulated vLLM OpenAI-compatible server running the NixlConnector in pull
// mode with bidirectional KV transfer.
//
// Every rule it follows is listed, with the vLLM file and function it
// comes from, in docs/simulator.md (configuration defaults, the pull
// connector, the scheduler, the answers' shapes, and what is not
// modelled). DefaultConfig is the bidirectional engine a router needs;
// vLLM's own defaults (no connector without --kv-transfer-config,
// bidirectional_kv_xfer off) are examples/vllmsim's.
//
// The pieces, one file each: a deterministic tokenizer (token.go), the chat
// templates (template.go: ChatML/Qwen3-like with enable_thinking, and
// Llama-3 with trim; content formats string and openai), request parsing as
// vLLM's pydantic models do it in lax mode (request.go, lax.go), the KV chain
// that makes every output a function of the KV actually held, with the
// generator's optional BPE drift and trailing whitespace (kv.go), a paged
// block pool with prefix caching (pool.go), kv_transfer_params handles
// (handle.go), the side channel between engines (peer.go, sidechannel.go),
// the scheduler that enforces KV capacity as vLLM's v1 scheduler does
// (sched.go: a first-come-first-served waiting queue, blocks allocated as
// requests grow, the last scheduled request preempted and recomputed,
// holds pinned), the clocks it passes modelled time on (clock.go), the
// cost model (cost.go) and the profiles' KV capacity (capacity.go),
// the CPU tier of vLLM's OffloadingConnector and its peer tier
// (cputier.go, cpuload.go; Config.CPUTier),
// vLLM's /metrics (metrics.go), logprobs (logprobs.go), the render and
// tokenize endpoints (render.go),
// chat messages and reasoning fields (message.go), OpenAI's Responses API
// and Anthropic's Messages API (apis.go converts their bodies to chat
// messages as vLLM does, respond_apis.go writes their bodies and streams
// from the chat reply), and the HTTP engine itself (engine.go, serve.go,
// turn.go, respond.go).
//
// POST /v1/responses and POST /v1/messages follow vLLM's
// entrypoints/openai/responses and entrypoints/anthropic: both are
// rendered by the chat template (the same conversation gives chat's
// tokens) and run the chat path through the engine, roles, pulls, holds,
// handles, costs and faults included; kv_transfer_params rides in their
// requests and non-streaming bodies (PRs #37424, #37535). A Responses
// stream is response.created, response.in_progress, per output item
// output_item.added, content_part.added, the deltas, the .done events and
// output_item.done, then response.completed wrapping the final object (the
// only event that carries the handle, as PR #37424 does: every engine but
// one with NoResponsesKV, with or without StreamHandles); a Messages
// stream is message_start, content blocks (thinking, then text),
// message_delta and message_stop, never with a handle.
//
// Behaviour that follows current vLLM by default: return_token_ids
// (prompt_token_ids, token_ids; null when not asked for), the render
// endpoints, /tokenize's reduced field set, the "reasoning" field, empty
// tool_calls left out, P's handle on any normal finish, X-Request-Id falling
// back to the body's request_id.
//
// Tool calls (toolcall.go), as a server run with --enable-auto-tool-choice
// and a hermes-style tool parser answers them
// (vllm/entrypoints/openai/chat_completion/serving.py,
// chat_completion_full_generator and chat_completion_stream_generator;
// vllm/parser/abstract_parser.py, DelegatingParser._extract_tool_calls):
//
//	tool_choice (chat; Responses; Messages)   the reply                        chat finish_reason; Messages stop_reason; Responses output
//	auto, the default with tools             text, then with probability      tool_calls; tool_use; message and function_call items
//	  ("auto"; "auto"; {"type":"auto"})       Config.ToolCallRate (from the     (no call: stop; end_turn; a message item)
//	                                          KV) "\n<tool_call>…</tool_call>"
//	required ("required"; "required";         the guided JSON list              tool_calls; tool_use; a function_call item
//	  {"type":"any"})                         [{"name", "parameters"}]
//	named ({"type":"function",...};           the generated text is the         stop; end_turn; a function_call item
//	  {"type":"function","name"};             tool's arguments (vLLM's guided
//	  {"type":"tool","name"})                 decoding would make them JSON)
//	none                                      text                              stop; end_turn; a message item
//
// A call's text is the generated tokens (D's KV holds them), and the chat
// template renders an assistant tool call as Qwen3's does, so an auto call
// echoed back is a prefix of the next prompt token for token; a required
// or named call is not (as in vLLM). Call ids: chat and Messages
// "chatcmpl-tool-" and 32 hex digits; Responses items "fc_" and a uuid
// with the chat call id as call_id, streamed a bare uuid with call_id
// "call_" and a uuid (simple_streaming_events.py). Streamed, the token
// that completes the call's name sends its id, type and name, the
// arguments' tokens their text, and the finish reason is tool_calls when a
// call was streamed and the generation stopped (non-streamed: whenever an
// auto call was found). A call cut by max_tokens is dropped from the whole
// answer, its text before it kept (the engine parsers drop incomplete
// markup); a stream has sent its name and the arguments so far.
//
// Reads are positional per KV group (the last
// len(local) blocks of each group); a group shorter than what the reader
// allocates trips the worker assert, which answers 500 and restarts the
// engine (Stats.AssertFailures). A hybrid model (hybrid.go:
// Config.GroupBlockSize, Config.SlidingWindow) has groups after the first
// of larger blocks whose handle lists hold only the window's tail, as
// vLLM's get_exchange_clipped_blocks sends them; /metrics reports only the
// first group's block size. A prefix-cache hit on KV that differs from
// the model-seed chain counts in Stats.PoisonedHits.
//
// Data-parallel ranks (rank.go, Config.DPSize) follow vLLM's engine cores:
// rank k's NIXL engine id is the engine's id suffixed "_dp<k>" (no suffix
// with one rank), its side channel is the base port + k
// (VLLM_NIXL_SIDE_CHANNEL_PORT + data_parallel_index), and it has its own
// block pool and held handles; one mutex and one monotonic clock serve them
// all. X-data-parallel-rank is read as the OpenAI server reads it (an
// unparsable value is ignored, an out-of-range one fails the request with
// 400, or inside a 200 stream for a streaming request); unpinned requests
// go round-robin, where vLLM's load balancer picks the least loaded rank.
// system_fingerprint (fingerprint.go, Config.Fingerprint) follows vLLM's
// --fingerprint-mode: on every non-streaming response, and in a stream on
// the finish chunks, or on the usage chunk when include_usage.
package sim
