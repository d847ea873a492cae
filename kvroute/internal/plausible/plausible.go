// Package plausible holds the ranges of the values a vLLM engine reports
// on GET /metrics that the router and the capability probe act on. A value
// outside them (a count that overflowed, a capacity below one block, a
// process start in the future) is no reading of a real engine: its reader
// ignores it, reports it, and keeps its last plausible value.
package plausible

import (
	"math"
	"strconv"
	"time"
)

// Metric names a value read from /metrics, as vLLM names it.
type Metric string

// The values checked.
const (
	BlockSize   Metric = "block_size"           // vllm:cache_config_info
	GPUBlocks   Metric = "num_gpu_blocks"       // vllm:cache_config_info, counting vLLM's null block
	KVTokens    Metric = "kv_cache_size_tokens" // vllm:cache_config_info, or (num_gpu_blocks-1) × block_size
	Usage       Metric = "kv_cache_usage_perc"  // vllm:kv_cache_usage_perc or vllm:gpu_cache_usage_perc
	Waiting     Metric = "num_requests_waiting" // vllm:num_requests_waiting
	Preemptions Metric = "num_preemptions_total"
	Start       Metric = "process_start_time_seconds"
)

// Bounds of the ranges.
const (
	// MaxBlockSize is the largest KV block size accepted (vLLM's are 1
	// to a few hundred tokens; hybrid models' attention blocks can reach
	// a few thousand).
	MaxBlockSize = 1 << 16
	// MaxGPUBlocks is the most KV blocks an engine can report (vLLM's
	// block ids are 32-bit).
	MaxGPUBlocks = math.MaxInt32
	// MinKVTokens and MaxKVTokens bound a KV capacity in tokens: at least
	// one block of the smallest usual size, at most 2^40 (a thousand
	// times the largest GPU pools).
	MinKVTokens = 16
	MaxKVTokens = 1 << 40
	// MaxWaiting bounds the requests an engine can report waiting.
	MaxWaiting = 10_000_000
	// MaxPreemptions bounds a preemption counter.
	MaxPreemptions = 1e15
	// MinStart is the earliest process start accepted (2001-09-09).
	MinStart = 1e9
	// ClockSkew is how far in the future of the reader's clock a process
	// start may lie (clocks kept in sync by NTP differ by far less).
	ClockSkew = time.Minute
)

// Check returns why v is not a plausible value of m read at now, or "" when
// it is. Counts must be whole numbers.
func Check(m Metric, v float64, now time.Time) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "not a number"
	}
	whole := v == math.Trunc(v)
	switch m {
	case BlockSize:
		return within(v, whole, 1, MaxBlockSize)
	case GPUBlocks:
		return within(v, whole, 2, MaxGPUBlocks) // the null block and one more
	case KVTokens:
		return within(v, whole, MinKVTokens, MaxKVTokens)
	case Usage:
		return within(v, true, 0, 1)
	case Waiting:
		return within(v, whole, 0, MaxWaiting)
	case Preemptions:
		return within(v, true, 0, MaxPreemptions)
	case Start:
		if v < MinStart {
			return "before " + time.Unix(MinStart, 0).UTC().Format(time.RFC3339)
		}
		if limit := now.Add(ClockSkew); v > float64(limit.UnixNano())/1e9 {
			return "in the future (the reader's clock is " + now.UTC().Format(time.RFC3339) + ")"
		}
		return ""
	}
	return "unknown metric"
}

func within(v float64, whole bool, lo, hi float64) string {
	switch {
	case !whole:
		return "not a whole number"
	case v < lo:
		return "below " + strconv.FormatFloat(lo, 'f', -1, 64)
	case v > hi:
		return "above " + strconv.FormatFloat(hi, 'f', -1, 64)
	}
	return ""
}

// Reading formats an implausible reading for a log line or a report:
// `kv_cache_size_tokens=9223372036854775807 (above 1099511627776)`.
func Reading(m Metric, raw, why string) string {
	if len(raw) > 40 {
		raw = raw[:40] + "..."
	}
	return string(m) + "=" + strconv.Quote(raw) + " (" + why + ")"
}
