// Package streamsynth writes a decode engine's non-streaming answer to a
// streaming client as the API's own stream: the event sequence the engine
// would have sent for the same answer, so that the official SDKs, Claude
// Code and any other client parse it unchanged.
//
// It serves bidikv's --decode-stream buffered: stock vLLM puts
// no decode handle in chat streams (that needs the unmerged PR #40186) and
// none ever in Messages streams, so streaming clients on stock engines
// never reuse KV. With buffering the router sends the decode leg
// non-streaming (its body carries the handle), keeps the handle, and
// writes the answer with this package once it has arrived.
//
// The trade, plainly: the first token arrives with the last. A buffered
// turn's time to first token is the whole decode time; what it gains is
// the KV reuse of every later turn, whose prefill is shorter. That suits
// headless agents (Claude Code with -p, CI agents, batch tools), where the
// whole turn's time is what counts, and not a person watching text
// appear.
//
// # The streams
//
//   - ChatCompletions: vLLM's chat.completion.chunk sequence. First, for
//     each choice, a chunk with delta {"role": "assistant", "content": ""}
//     (and the prompt's token ids when the answer has them); then, choice
//     by choice, the reasoning (in the member the answer uses, reasoning or
//     reasoning_content), the content and each tool call (index, id, type,
//     function.name with empty arguments, then the arguments) each in one
//     chunk, and a finish chunk with an empty delta, finish_reason and
//     stop_reason; then the
//     usage chunk ("choices": []) when stream_options.include_usage is
//     set, and data: [DONE]. id, created, model and system_fingerprint
//     come from the answer.
//   - Completions: per choice a text_completion chunk with the whole text,
//     then a finish chunk; the usage chunk when asked; data: [DONE].
//   - Messages: Anthropic's named events: message_start (the answer with
//     an empty content, null stop_reason and stop_sequence, output_tokens
//     0), per content block content_block_start, content_block_delta
//     (text_delta; thinking_delta then signature_delta; input_json_delta
//     whose partial_json is the tool input's JSON text) and
//     content_block_stop, then message_delta (stop_reason, stop_sequence,
//     the answer's usage) and message_stop.
//
// Each text (content, reasoning, a tool call's arguments, a block's text,
// thinking or input) leaves whole in one delta rather than split into
// pieces: every client concatenates deltas, so one is as good as many,
// and one keeps the answer's bytes uncopied. It also makes the SDKs'
// reassembly exact where they overwrite rather than append: the OpenAI
// SDK's stream helper keeps only the last delta of a member it does not
// know, such as reasoning. Logprobs and token ids, when the answer has
// them, ride whole on the first delta chunk of their choice, so the
// SDKs' reassembled logprobs equal the answer's.
//
// The Responses API has no synthesizer: its streams carry the handle on
// response.completed (vLLM PR #37424), and a router never buffers a
// stream that carries the handle.
//
// # Memory
//
// The answer is held once, in the body the caller read (and counts against
// its body budget). API.Write validates the body in one pass, then writes
// the events through a 4 KiB buffer: short members are assembled there,
// and every long value goes from the body to the writer without a copy.
// Writing an answer allocates twice whatever its size: the output buffer
// and the index of the body's top-level members (once with a caller's
// *bufio.Writer of 4 KiB or more); a member name jsonraw does not intern
// costs one more (TestWriteAllocations, BenchmarkWrite).
//
// # Errors
//
// Write validates the whole answer before writing a byte: an answer that
// is not of the API's shape is ErrMalformed and nothing was written. After
// the stream's headers are sent, an engine's error answer can only become
// the API's stream error event: API.WriteError writes the engine's own
// error body as that event when it has the API's shape, and otherwise
// calls the router's ErrorEvent (Response.ErrorEvent), so that every
// error a client sees has one shape.
//
// # What the router does (kvroute's wiring)
//
//   - Buffer only when the API's decode stream carries no handle on the
//     engine that decodes the turn (chat without PR #40186, Messages
//     always), and never when it does: a streaming engine with handles
//     keeps real streaming. Responses is never buffered.
//   - Send the decode leg with "stream": false and without
//     stream_options (vLLM rejects stream_options on a non-streaming
//     request); read the client's stream_options into Options as vLLM
//     reads flags (pydantic's lax bools, kvroute's lenientBool).
//   - Read the answer into one buffer counted against the body budget
//     (the same bound as any non-streaming answer), take the handle and
//     the reply from it as for a non-streaming turn (retain, fingerprint),
//     strip kv_transfer_params (sse.Scrub) and the token ids the client
//     did not ask for, then call Write.
//   - Headers: the answer's own, with SetHeader (Content-Type
//     text/event-stream; charset=utf-8, no Content-Length or
//     Content-Encoding); X-Bidikv-Reuse and X-Request-Id unchanged.
//   - An engine error before the headers are sent goes to the client as
//     it is (status and JSON body), as for a streaming request; after them
//     (when the router sent KeepAlive comments while waiting), WriteError
//     with the router's ErrorEvent. A malformed 200 answer is a 502 before
//     the headers, the router's error event after them; never a partial
//     stream.
//   - Count buffered turns per API, and log the mode once at start-up
//     with its trade.
package streamsynth
