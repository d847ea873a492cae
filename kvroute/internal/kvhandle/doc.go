// Package kvhandle reads and rewrites vLLM's KV transfer handles (the
// kv_transfer_params of an engine's answer) as the router must: Check
// refuses a handle vLLM would misread, Miss is the handle of a turn
// without reuse, ForHit and Cut make a retained decode handle into what a
// prefill engine reads. A handle is opaque JSON: numbers are kept as
// written and unknown members forwarded.
package kvhandle
