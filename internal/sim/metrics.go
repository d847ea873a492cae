package sim

import (
	"fmt"
	"math"
	"net/http"
	"strconv"
	"strings"
)

// Names of the KV usage gauge, Config.UsageMetric.
const (
	// UsageMetricCurrent writes vllm:kv_cache_usage_perc (vLLM 0.9 on).
	UsageMetricCurrent = "current"
	// UsageMetricLegacy writes vllm:gpu_cache_usage_perc, the name before
	// vLLM 0.9.
	UsageMetricLegacy = "legacy"
	// UsageMetricBoth writes both, as vLLM 0.9 and 0.10 did (the old name
	// deprecated).
	UsageMetricBoth = "both"
)

// serveMetrics serves GET /metrics as vLLM's API server does, in Prometheus'
// text format as Python's prometheus_client writes it (vllm/v1/metrics/
// loggers.py, PrometheusStatLogger):
//
//   - process_start_time_seconds, the process collector's (the start of
//     the engine's current process in Unix seconds; a restart changes it);
//   - per data-parallel rank (label engine, with model_name the served
//     model): vllm:num_requests_running, vllm:num_requests_waiting (a request
//     loading from a remote is waiting), vllm:kv_cache_usage_perc (0 to 1:
//     the share of usable blocks allocated, holds included; or
//     vllm:gpu_cache_usage_perc, Config.UsageMetric),
//     vllm:num_preemptions_total (a counter, with its _created sample);
//   - vllm:cache_config_info, an info gauge set to 1 per rank whose labels
//     are CacheConfig.metrics_info() (every field of vLLM's CacheConfig as
//     str() writes it, current main's fields; num_gpu_blocks counts the null
//     block, kv_cache_size_tokens the usable capacity) and engine.
//
// Floats are formatted as the Python client formats them (floatToGoString:
// 0.0, 0.25, 1.71855734213e+09).
func (e *Engine) serveMetrics(w http.ResponseWriter) {
	e.mu.Lock()
	e.sweep(e.clock.Now())
	start := float64(e.start.UnixNano()) / 1e9
	type rankMetrics struct {
		running, waiting, preemptions int
		usage                         float64
		tier                          tierMetrics
	}
	ranks := make([]rankMetrics, len(e.ranks))
	for k, r := range e.ranks {
		size := r.pool.size()
		ranks[k] = rankMetrics{running: r.slots(), waiting: len(r.waiting) + len(r.loaded) + r.pulls, preemptions: r.preemptions,
			usage: float64(size-r.pool.freeCount()) / float64(size), tier: e.tierMetrics(r)}
	}
	e.mu.Unlock()

	var b strings.Builder
	metric := func(name, typ, help string) {
		fmt.Fprintf(&b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, typ)
	}
	sample := func(name string, v float64, labels ...string) {
		b.WriteString(name)
		if len(labels) > 0 {
			b.WriteByte('{')
			for i := 0; i+1 < len(labels); i += 2 {
				if i > 0 {
					b.WriteByte(',')
				}
				fmt.Fprintf(&b, "%s=\"%s\"", labels[i], escapeLabel(labels[i+1]))
			}
			b.WriteByte('}')
		}
		b.WriteByte(' ')
		b.WriteString(pyFloat(v))
		b.WriteByte('\n')
	}
	model := e.cfg.Model
	perRank := func(name, typ, help string, value func(rankMetrics) float64) {
		metric(name, typ, help)
		for k, r := range ranks {
			sample(name, value(r), "model_name", model, "engine", strconv.Itoa(k))
		}
	}

	metric("process_start_time_seconds", "gauge", "Start time of the process since unix epoch in seconds.")
	sample("process_start_time_seconds", start)
	perRank("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
		func(r rankMetrics) float64 { return float64(r.running) })
	perRank("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
		func(r rankMetrics) float64 { return float64(r.waiting) })
	usage := func(r rankMetrics) float64 { return r.usage }
	if m := e.cfg.UsageMetric; m == UsageMetricLegacy || m == UsageMetricBoth {
		help := "GPU KV-cache usage. 1 means 100 percent usage."
		if m == UsageMetricBoth {
			help += "DEPRECATED: Use vllm:kv_cache_usage_perc instead."
		}
		perRank("vllm:gpu_cache_usage_perc", "gauge", help, usage)
	}
	if m := e.cfg.UsageMetric; m != UsageMetricLegacy {
		perRank("vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.", usage)
	}
	perRank("vllm:num_preemptions_total", "counter", "Cumulative number of preemption from the engine.",
		func(r rankMetrics) float64 { return float64(r.preemptions) })
	perRank("vllm:num_preemptions_created", "gauge", "Cumulative number of preemption from the engine.",
		func(rankMetrics) float64 { return start })
	if e.cfg.CPUTier.enabled() {
		for _, s := range tierSeries {
			perRank(s.name, s.typ, s.help, func(r rankMetrics) float64 { return s.value(r.tier) })
		}
	}
	metric("vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig")
	for k := range ranks {
		sample("vllm:cache_config_info", 1, append(e.cfg.cacheConfigInfo(), "engine", strconv.Itoa(k))...)
	}

	w.Header().Set("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
	_, _ = w.Write([]byte(b.String()))
}

// cacheConfigInfo is vLLM's CacheConfig.metrics_info() for the engine, as
// label pairs in CacheConfig's field order (current main): str() of each
// value, so True, None, 0.9, []. A hybrid model (hybrid.go) reports its
// full-attention group's block size as block_size and
// effective_attention_block_size (EngineCore's
// _initialize_effective_attention_block_size: the one full-attention block
// size); its other groups' sizes appear nowhere on /metrics.
func (c *Config) cacheConfigInfo() []string {
	py := func(b bool) string {
		if b {
			return "True"
		}
		return "False"
	}
	bs := strconv.Itoa(c.BlockSize)
	window := "None"
	if c.SlidingWindow > 0 {
		window = strconv.Itoa(c.SlidingWindow) // the model's, duplicated in CacheConfig
	}
	return []string{
		"block_size", bs,
		"user_specified_block_size", py(c.BlockSize != 16),
		"user_specified_mamba_block_size", "False",
		"kv_cache_layout", "LBNHC",
		"prefix_match_unit", bs,
		"gpu_memory_utilization", pyFloat(GPUMemoryUtilization),
		"cache_dtype", "auto",
		"is_attention_free", "False",
		"num_gpu_blocks_override", "None",
		"sliding_window", window,
		"enable_prefix_caching", py(c.PrefixCaching),
		"prefix_caching_hash_algo", c.CPUTier.algo(),
		"attn_group_size", "None",
		"prefix_cache_retention_interval", "0",
		"kv_cache_dtype_skip_layers", "[]",
		"mamba_page_size_padded", "None",
		"skip_page_size_padded", "None",
		"mamba_block_size", "None",
		"mamba_cache_dtype", "auto",
		"mamba_ssm_cache_dtype", "auto",
		"mamba_cache_mode", "none",
		"enable_mamba_fine_grained_prefix_cache", "False",
		"replayssm_buffer_len", "16",
		"use_replayssm", "False",
		"use_kda_recoverssm", "False",
		"num_gpu_blocks", strconv.Itoa(c.NumBlocks + 1),
		"num_cpu_blocks", "None",
		"effective_attention_block_size", bs,
		"kv_cache_size_tokens", strconv.Itoa(c.NumBlocks * c.BlockSize),
		"kv_cache_max_concurrency", "1.0",
		"kv_sharing_fast_prefill", "False",
		"kv_cache_memory_bytes", "None",
		"kv_offloading_size", "None",
		"kv_offloading_backend", "native",
	}
}

// escapeLabel escapes a label value as the text format requires.
func escapeLabel(s string) string {
	return strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`).Replace(s)
}

// pyFloat formats f as prometheus_client's floatToGoString: Python's repr
// (0.0, 0.25, 1e-05), switched to an exponent, as Go does, for positive
// values with more than six digits before the point.
func pyFloat(f float64) string {
	switch {
	case math.IsInf(f, 1):
		return "+Inf"
	case math.IsInf(f, -1):
		return "-Inf"
	case math.IsNaN(f):
		return "NaN"
	}
	var s string
	if a := math.Abs(f); a == 0 || (a >= 1e-4 && a < 1e16) {
		s = strconv.FormatFloat(f, 'f', -1, 64)
		if !strings.ContainsAny(s, ".") {
			s += ".0"
		}
	} else {
		// Python's repr: 1e-05, 1.5e+16
		s = strconv.FormatFloat(f, 'e', -1, 64)
		mant, exp, _ := strings.Cut(s, "e")
		sign, digits := exp[:1], strings.TrimLeft(exp[1:], "0")
		if len(digits) < 2 {
			digits = strings.Repeat("0", 2-len(digits)) + digits
		}
		return mant + "e" + sign + digits
	}
	if dot := strings.IndexByte(s, '.'); f > 0 && dot > 6 {
		mantissa := strings.TrimRight(s[:1]+"."+s[1:dot]+s[dot+1:], "0.")
		return fmt.Sprintf("%se+0%d", mantissa, dot-1)
	}
	return s
}
