// Package sse reads, forwards and inspects Server-Sent Events streams such as
// the streaming responses of vLLM's /v1/chat/completions and /v1/completions.
//
// A Reader splits a byte stream into events following the WHATWG framing
// rules and keeps the exact bytes of each event, so that a proxy can forward
// them untouched. A Writer forwards bytes to an http.ResponseWriter and
// flushes after every event. A Capture looks at each event of an engine's
// stream, removes the top-level kv_transfer_params member (the decode
// engine's KV handle, which must never reach a client) and remembers the
// handle, the finish reason, the usage and, optionally, the reply text.
package sse
