package capability

import (
	"fmt"
	"strconv"
	"strings"
	"time"
)

// Report is what a probe learned of one engine.
type Report struct {
	// Endpoint is the engine's base URL (with " (rank N)" for an endpoint
	// pinned to a data-parallel rank).
	Endpoint string    `json:"endpoint"`
	ProbedAt time.Time `json:"probed_at"`
	// Reachable reports that the engine answered at least one request;
	// Error is the first failure to reach it otherwise.
	Reachable bool   `json:"reachable"`
	Error     string `json:"error,omitempty"`

	// Version is GET /version's answer; VLLMVersion its version string.
	Version     Fact   `json:"version"`
	VLLMVersion string `json:"vllm_version,omitempty"`
	// Model and MaxModelLen are the first model GET /v1/models lists.
	Model       string `json:"model,omitempty"`
	MaxModelLen int    `json:"max_model_len,omitempty"`

	// Render is each API's render route (POST <path>/render): the prompt's
	// tokens exactly as generation computes them.
	Render PerAPI `json:"render"`
	// Tokenize is POST /tokenize, the older tokenizer (chat and
	// completions requests that use none of the fields it ignores).
	Tokenize Fact `json:"tokenize"`
	// ReturnTokenIDs is return_token_ids on chat and completions (the
	// decode answer's token ids, for token verification).
	ReturnTokenIDs Fact `json:"return_token_ids"`
	// Handles is kv_transfer_params accepted in requests and returned in
	// non-streaming bodies, per API.
	Handles PerAPI `json:"handles"`
	// StreamHandles is a decode handle in streams, per API: chat and
	// completions need vLLM PR #40186 (unmerged), Responses streams carry
	// it on response.completed, Messages streams never.
	StreamHandles PerAPI `json:"stream_handles"`
	// Bidirectional is bidirectional_kv_xfer in the engine's
	// --kv-transfer-config: not observable by a probe, learned from turns.
	Bidirectional Fact `json:"bidirectional"`
	// PrefixCaching is vllm:cache_config_info's enable_prefix_caching.
	PrefixCaching Fact `json:"prefix_caching"`
	// Metrics is GET /metrics with vllm:cache_config_info.
	Metrics Fact `json:"metrics"`
	// BlockSize, NumGPUBlocks and KVCacheTokens are the KV pool of one
	// data-parallel rank (vllm:cache_config_info: block_size, or
	// effective_attention_block_size where the engine reports one, the
	// block size its handles follow; num_gpu_blocks; kv_cache_size_tokens
	// or else their product); 0 when unknown.
	BlockSize     int   `json:"block_size,omitempty"`
	NumGPUBlocks  int   `json:"num_gpu_blocks,omitempty"`
	KVCacheTokens int64 `json:"kv_cache_tokens,omitempty"`
	// DataParallel is the number of data-parallel ranks reporting a
	// cache configuration (0 when unknown).
	DataParallel int `json:"data_parallel_ranks,omitempty"`
	// HashAlgo is vllm:cache_config_info's prefix_caching_hash_algo (the
	// block hash the prefix cache and the CPU tier key chunks by); "" when
	// unknown.
	HashAlgo string `json:"prefix_caching_hash_algo,omitempty"`
	// KVOffload is an offloading connector on the engine (vLLM's
	// OffloadingConnector, alone or in a MultiConnector): Present when
	// /metrics has a vllm:kv_offload_* series or its # TYPE line (vLLM's
	// stat logger registers the connector's series at start), Absent when
	// /metrics answers without one, Unknown when /metrics did not answer.
	// Its configuration (offload_prompt_only, the tiers, the capacity) is
	// not exported.
	KVOffload Fact `json:"kv_offload"`
	// OffloadStoreBytes and OffloadLoadBytes are the bytes the engine's
	// offloading connector has moved GPU→CPU tier and CPU tier→GPU
	// (vllm:kv_offload_store_bytes_total and _load_bytes_total, summed over
	// data-parallel ranks): counters, compared before and after a probe.
	OffloadStoreBytes float64 `json:"kv_offload_store_bytes,omitempty"`
	OffloadLoadBytes  float64 `json:"kv_offload_load_bytes,omitempty"`
	// ProcessStart is process_start_time_seconds: a restart changes it.
	ProcessStart time.Time `json:"process_start,omitzero"`
	// Implausible lists the values of /metrics no real engine reports (a
	// count that overflowed, a capacity below one block, a process start in
	// the future), as `name="value" (why)`: they were ignored, and the
	// facts they would have set keep their last plausible values (unknown
	// on a first probe).
	Implausible []string `json:"implausible_metrics,omitempty"`
}

// Capability names, as Facts and Learn use them (and metrics label them).
const (
	NameVersion        = "version"
	NameTokenize       = "tokenize"
	NameReturnTokenIDs = "return_token_ids"
	NameBidirectional  = "bidirectional"
	NamePrefixCaching  = "prefix_caching"
	NameMetrics        = "metrics"
)

// RenderName, HandlesName and StreamHandlesName name a per-API capability:
// "render_chat", "handles_responses", "stream_handles_messages".
func RenderName(a API) string        { return "render_" + string(a) }
func HandlesName(a API) string       { return "handles_" + string(a) }
func StreamHandlesName(a API) string { return "stream_handles_" + string(a) }

// Named is one capability of a Report under its name.
type Named struct {
	Name string
	Fact Fact
}

// Facts returns every capability in a fixed order: version, render per
// API, tokenize, return_token_ids, handles per API, stream handles per API,
// bidirectional, prefix_caching, metrics.
func (r *Report) Facts() []Named {
	out := []Named{{NameVersion, r.Version}}
	for _, a := range APIs {
		out = append(out, Named{RenderName(a), r.Render.Get(a)})
	}
	out = append(out, Named{NameTokenize, r.Tokenize}, Named{NameReturnTokenIDs, r.ReturnTokenIDs})
	for _, a := range APIs {
		out = append(out, Named{HandlesName(a), r.Handles.Get(a)})
	}
	for _, a := range APIs {
		out = append(out, Named{StreamHandlesName(a), r.StreamHandles.Get(a)})
	}
	return append(out, Named{NameBidirectional, r.Bidirectional}, Named{NamePrefixCaching, r.PrefixCaching},
		Named{NameMetrics, r.Metrics})
}

// Learn records what real turns showed of a capability (name as in
// Facts), replacing what the probe concluded; false for an unknown name.
// Use it for what a probe cannot see: stream handles per API (a decode
// stream that ended normally with or without a handle) and bidirectional
// (a decode answer to a request carrying P's handle, with or without one).
func (r *Report) Learn(name string, f Fact) bool {
	if p := r.fact(name); p != nil {
		*p = f
		return true
	}
	return false
}

// Fact returns the capability called name (as in Facts) and whether
// there is one.
func (r *Report) Fact(name string) (Fact, bool) {
	if p := r.fact(name); p != nil {
		return *p, true
	}
	return Fact{}, false
}

func (r *Report) fact(name string) *Fact {
	switch name {
	case NameVersion:
		return &r.Version
	case NameTokenize:
		return &r.Tokenize
	case NameReturnTokenIDs:
		return &r.ReturnTokenIDs
	case NameBidirectional:
		return &r.Bidirectional
	case NamePrefixCaching:
		return &r.PrefixCaching
	case NameMetrics:
		return &r.Metrics
	}
	for _, a := range APIs {
		switch name {
		case RenderName(a):
			return r.Render.ptr(a)
		case HandlesName(a):
			return r.Handles.ptr(a)
		case StreamHandlesName(a):
			return r.StreamHandles.ptr(a)
		}
	}
	return nil
}

// Token sources of TokenPath.
const (
	TokensRender   = "render"
	TokensTokenize = "tokenize"
	TokensNone     = "none"
)

// TokenPath says how a prefill engine with this report gives API a's
// prompt tokens for token verification: TokensRender (its render route),
// TokensTokenize (chat and completions without the render route: POST
// /tokenize, for requests that use none of the fields it ignores) or
// TokensNone, with the Fact behind it (Absent with the fix when no source
// is left, Unknown when the probe could not tell).
func (r *Report) TokenPath(a API) (string, Fact) {
	render := r.Render.Get(a)
	if render.Is(Present) {
		return TokensRender, render
	}
	if (a == Chat || a == Completions) && r.Tokenize.Is(Present) {
		return TokensTokenize, Fact{State: Present,
			Why: "render: " + render.or("unknown") + "; POST /tokenize serves requests without tool_choice, documents, reasoning_effort or response_format",
			Fix: render.Fix}
	}
	if render.Is(Unknown) || ((a == Chat || a == Completions) && r.Tokenize.Is(Unknown)) {
		return TokensNone, unknown("render: " + render.or("unknown"))
	}
	return TokensNone, absent("render: "+render.or("absent"), render.Fix)
}

// Summary is one line: the version and model, then what works, what does
// not and why, and what is unknown.
func (r *Report) Summary() string {
	if !r.Reachable {
		return "unreachable: " + orWhy(r.Error, "no answer")
	}
	var b strings.Builder
	if r.VLLMVersion != "" {
		b.WriteString("vLLM " + r.VLLMVersion)
	} else {
		b.WriteString("version unknown")
	}
	if r.Model != "" {
		b.WriteString(", model " + r.Model)
	}
	if r.BlockSize > 0 {
		fmt.Fprintf(&b, ", KV %s tokens (%d blocks of %d", count(r.KVCacheTokens), r.NumGPUBlocks, r.BlockSize)
		if r.DataParallel > 1 {
			fmt.Fprintf(&b, ", per rank of %d", r.DataParallel)
		}
		b.WriteString(")")
	}
	var ok, missing, unk []string
	for _, n := range Fold(r.Facts()) {
		switch n.Fact.State {
		case Present:
			ok = append(ok, n.Name)
		case Absent:
			missing = append(missing, n.Name+" ("+n.Fact.Why+")")
		default:
			unk = append(unk, n.Name)
		}
	}
	if len(ok) > 0 {
		b.WriteString("; works: " + strings.Join(ok, " "))
	}
	if len(missing) > 0 {
		b.WriteString("; missing: " + strings.Join(missing, ", "))
	}
	if len(unk) > 0 {
		b.WriteString("; unknown: " + strings.Join(unk, " "))
	}
	if len(r.Implausible) > 0 {
		b.WriteString("; implausible /metrics values ignored: " + strings.Join(r.Implausible, ", "))
	}
	return b.String()
}

// Fold folds each per-API capability of facts (as Facts lists them) whose
// four facts agree into one entry named without the API ("render",
// "handles", "stream_handles"): the same state and, unless Present, the
// same reason once each render route's path is left out, which the folded
// Fact keeps (with the first fact's Fix). Other facts are kept as they are.
func Fold(facts []Named) []Named {
	out := make([]Named, 0, len(facts))
	for i := 0; i < len(facts); i++ {
		if n, ok := fold(facts[i:]); ok {
			out = append(out, n)
			i += len(APIs) - 1
			continue
		}
		out = append(out, facts[i])
	}
	return out
}

// fold folds the per-API facts at the start of facts, if they agree.
func fold(facts []Named) (Named, bool) {
	if len(facts) < len(APIs) {
		return Named{}, false
	}
	first := facts[0]
	prefix, ok := strings.CutSuffix(first.Name, "_"+string(APIs[0]))
	if !ok {
		return Named{}, false
	}
	strip := func(i int) string {
		w := facts[i].Fact.Why
		if after, found := strings.CutPrefix(w, "POST "+APIs[i].RenderPath()+": "); found {
			return after
		}
		return w
	}
	why := strip(0)
	for i, a := range APIs {
		if facts[i].Name != prefix+"_"+string(a) || facts[i].Fact.State != first.Fact.State ||
			(first.Fact.State != Present && strip(i) != why) {
			return Named{}, false
		}
	}
	if first.Fact.State == Present {
		why = "every API"
	}
	return Named{Name: prefix, Fact: Fact{State: first.Fact.State, Why: why, Fix: first.Fact.Fix}}, true
}

// count writes n with a k or M suffix when it is a round enough figure.
func count(n int64) string {
	switch {
	case n >= 10_000_000:
		return strconv.FormatInt(n/1_000_000, 10) + "M"
	case n >= 10_000:
		return strconv.FormatInt(n/1000, 10) + "k"
	}
	return strconv.FormatInt(n, 10)
}
