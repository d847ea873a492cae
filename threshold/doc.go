// Package threshold decides whether attaching a retained decode handle to the
// next prefill request is worthwhile.
//
// The prefill engine makes the final call itself: it pulls
// min(remote_num_tokens, prompt tokens) minus its local prefix-cache hit
// tokens from the decode engine, or recomputes them when that count is below
// its kv_recompute_threshold. A [Policy] lets the router make the same call
// earlier, with what it knows, so that it can skip a handle the engine would
// not use. The router does not tokenize, so the prompt length and the cached
// count may be unknown; [Input] marks them as 0.
package threshold
