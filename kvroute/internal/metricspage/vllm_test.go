package metricspage

import (
	"fmt"
	"math"
	"strings"
	"testing"
	"time"
)

// simMetrics is a decode engine's /metrics as vLLM (and the simulator)
// write it: two data-parallel ranks.
const simMetrics = `# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.
# TYPE process_start_time_seconds gauge
process_start_time_seconds 1.71855734213e+09
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 3.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="m"} 2.0
vllm:num_preemptions_created{engine="0",model_name="m"} 1.7e+09
vllm:num_preemptions_total{engine="1",model_name="m"} 5.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",kv_cache_size_tokens="1024",num_gpu_blocks="65"} 1.0
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="1",num_gpu_blocks="65"} 1.0
`

// simNow is when simMetrics is read.
var simNow = time.Unix(1718557342, 0).Add(time.Hour)

// Parse reads a rank's samples, or sums them over the ranks; the
// capacity is kv_cache_size_tokens, else num_gpu_blocks less the null
// block × block_size.
func TestParseMetrics(t *testing.T) {
	for _, tc := range []struct {
		rank        int
		usage       float64
		waiting     int
		preemptions float64
		capacity    int64
	}{
		{0, 0.25, 3, 2, 1024},
		{1, 0.75, 1, 5, 1024},
		{-1, 1.0 / 2 * (0.25 + 0.75) * 2, 4, 7, 2048},
	} {
		m := Parse(strings.NewReader(simMetrics), tc.rank, simNow)
		usage := m.Usage / float64(m.Usages)
		if tc.rank < 0 {
			usage = m.Usage // summed: the caller averages
		}
		capacity, blockSize, cacheInfo := m.Capacity()
		if usage != tc.usage || m.Waiting != tc.waiting || m.Preemptions != tc.preemptions || capacity != tc.capacity ||
			blockSize != 16 || !cacheInfo || !m.Preempts {
			t.Errorf("rank %d: %+v", tc.rank, m)
		}
		if d := m.Start.Sub(time.Unix(1718557342, 130000000)); d < -time.Millisecond || d > time.Millisecond {
			t.Errorf("start %v", m.Start)
		}
	}
	legacy := Parse(strings.NewReader(`vllm:gpu_cache_usage_perc{engine="0"} 0.5`), 0, simNow)
	if legacy.Usages != 1 || legacy.Usage != 0.5 {
		t.Errorf("legacy usage: %+v", legacy)
	}
}

// FuzzParseMetrics: any page parses without panicking into figures that
// are finite and not negative where they must not be.
func FuzzParseMetrics(f *testing.F) {
	f.Add(simMetrics, 0)
	f.Add(`vllm:cache_config_info{block_size="16",num_gpu_blocks="1"} 1`, -1)
	f.Add(`vllm:kv_cache_usage_perc{engine="0\\"} 0.5`, 0)
	f.Add("process_start_time_seconds NaN\nvllm:num_requests_waiting -1e308", 0)
	f.Fuzz(func(t *testing.T, page string, rank int) {
		m := Parse(strings.NewReader(page), rank, simNow)
		if math.IsNaN(m.Usage) || math.IsInf(m.Usage, 0) || math.IsNaN(m.Preemptions) || math.IsInf(m.Preemptions, 0) {
			t.Fatalf("non-finite figures: %+v", m)
		}
		capacity, blockSize, cacheInfo := m.Capacity()
		if capacity < 0 || (cacheInfo && (capacity == 0 || blockSize <= 0)) {
			t.Fatalf("capacity: %+v", m)
		}
	})
}

// Implausible values leave their figure out of the reading, noted: the
// capacity (any rank's overflowed or below one block), the usage, the
// waiting requests, the preemptions, the process start.
func TestParseMetricsImplausible(t *testing.T) {
	page := fmt.Sprintf(`process_start_time_seconds %d
vllm:num_requests_waiting{engine="0"} 1e20
vllm:kv_cache_usage_perc{engine="0"} 7.5
vllm:num_preemptions_total{engine="0"} -3
vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="1024"} 1.0
vllm:cache_config_info{block_size="8",engine="1",num_gpu_blocks="2305843009213693954"} 1.0
`, simNow.Add(time.Hour).Unix())
	m := Parse(strings.NewReader(page), -1, simNow)
	capacity, _, cacheInfo := m.Capacity()
	if !m.Start.IsZero() || !m.BadUsage || !m.BadWaiting || m.Preempts || cacheInfo || capacity != 0 || len(m.Absurd) != 5 {
		t.Errorf("%+v", m)
	}
	tiny := Parse(strings.NewReader(`vllm:cache_config_info{block_size="16",kv_cache_size_tokens="8"} 1.0`), 0, simNow)
	if _, _, cacheInfo := tiny.Capacity(); cacheInfo || len(tiny.Absurd) != 1 {
		t.Errorf("a capacity of 8 tokens: %+v", tiny)
	}
}
