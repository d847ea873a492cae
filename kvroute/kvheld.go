package kvroute

import (
	"slices"
	"time"
)

// DecodeKV is the KV one decode engine holds for the live handles this
// Router retained (stored, not yet attached to a prefill request nor
// released, and not past the retention TTL), with its budget and the
// pressure the router last read (WithDecodeMemory). It is the memory the
// retention TTL trades against the hit rate. A handle the Store dropped
// early (evicted, or replaced by a later turn of the same conversation)
// is counted until its TTL; other Router replicas' handles are not
// counted.
type DecodeKV struct {
	// Endpoint is the decode endpoint (its URL).
	Endpoint string
	// Handles is the number of live retained handles on it.
	Handles int
	// Tokens is their remote_num_tokens, summed.
	Tokens int64
	// Bytes is Tokens × WithDecodeMemory's KVBytesPerToken, 0 when that is unset.
	Bytes int64
	// HeldTokens is the memory they pin, in whole blocks × the engine's
	// block size: what counts against the budget.
	HeldTokens int64
	// Capacity is the engine's KV capacity in tokens (its /metrics, or
	// WithDecodeMemory's Capacity), 0 when unknown; Budget the share of it
	// this Router's holds may take (WithDecodeMemory's Budget), 0 when
	// there is none.
	Capacity, Budget int64
	// MaxModelLen is the engine's max_model_len (its GET /v1/models, read
	// beside its /metrics), 0 when unknown: the most a request may take
	// there, prompt and max_tokens together.
	MaxModelLen int64
	// Ages counts the handles by age, in the buckets of budget.AgeBounds
	// (up to 15 s, 30 s, 1, 2, 4 and 8 min) and one for older ones.
	Ages [7]int
	// KVUsage, Waiting and Preemptions are the engine's
	// vllm:kv_cache_usage_perc (0 to 1; -1 when it reports none),
	// vllm:num_requests_waiting and vllm:num_preemptions_total at the
	// router's last reading of its /metrics, at MetricsRead (zero: never
	// read).
	KVUsage     float64
	Waiting     int
	Preemptions int64
	MetricsRead time.Time
}

// DecodeKV returns, for every decode endpoint, the KV it holds for this
// Router's live retained handles, in the endpoints' order. Endpoints that
// were removed but still hold handles follow.
func (r *Router) DecodeKV() []DecodeKV {
	now := r.cfg.clock()
	var out []DecodeKV
	for _, e := range r.decode.list() {
		d := DecodeKV{Endpoint: e.url}
		p := e.mem.Snapshot()
		if !p.At.IsZero() {
			d.KVUsage, d.Waiting, d.Preemptions, d.MetricsRead = p.Usage, p.Waiting, int64(p.Preemptions), p.At
		}
		d.MaxModelLen = p.MaxModelLen
		out = append(out, d)
	}
	var gone []DecodeKV
	for _, u := range r.mem.ledger.Usage(now) {
		d := DecodeKV{Endpoint: u.Engine}
		i := slices.IndexFunc(out, func(d DecodeKV) bool { return d.Endpoint == u.Engine })
		if i >= 0 {
			d = out[i]
		} else if u.Holds == 0 {
			continue
		}
		d.Handles, d.Tokens, d.HeldTokens = u.Holds, u.Tokens, u.HeldTokens
		d.Capacity, d.Budget = u.Capacity, u.Budget
		copy(d.Ages[:], u.Ages[:])
		if i >= 0 {
			out[i] = d
		} else {
			gone = append(gone, d)
		}
	}
	slices.SortFunc(gone, func(a, b DecodeKV) int {
		if a.Endpoint < b.Endpoint {
			return -1
		}
		if a.Endpoint > b.Endpoint {
			return 1
		}
		return 0
	})
	out = append(out, gone...)
	for i := range out {
		out[i].Bytes = out[i].Tokens * r.cfg.kvBytesPerToken
	}
	return out
}
