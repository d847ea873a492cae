// Package sse reads, forwards and scrubs Server-Sent Events streams such as
// the streaming responses of vLLM's /v1/chat/completions and /v1/completions.
//
// A Reader splits a byte stream into events following the WHATWG framing
// rules and keeps the exact bytes of each event, so that a proxy can forward
// them untouched. A Writer forwards bytes to an http.ResponseWriter and
// flushes after every event. Scrub and ScrubEvent are the one mechanism
// an engine's answer goes through on its way to a client: every member
// whose decoded name is kv_transfer_params (the decode engine's KV handle,
// which must never reach a client) is removed at any depth, and what may
// hide a handle otherwise (data that is not JSON, a handle's members
// elsewhere, lines a client ignores) fails or is dropped.
//
// Migration: the stream captures (Capture, NewCapture, CaptureOption,
// WithReply, WithTokenIDs, Reply, and the token-id helpers AppendTokenIDs,
// StripTokenIDs, PromptTokenIDsKey, TokenIDsKey) moved next to kvroute's
// other captures, inside kvroute; a program that forwards a stream itself
// calls ScrubEvent on each event, and kvroute.Reply is the reply type.
package sse
