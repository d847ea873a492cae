package metricspage

import (
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/plausible"
)

var now = time.Unix(1_750_000_000, 0)

// TestRules pins the one set of validity rules every reader of /metrics
// follows.
func TestRules(t *testing.T) {
	page := strings.Join([]string{
		"# HELP process_start_time_seconds Start time of the process",
		"process_start_time_seconds 1.7499e+09",
		"process_start_time_seconds 1.6e+09", // the first one counts
		`vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25`,
		`vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5`,
		`vllm:gpu_cache_usage_perc{engine="0"} 0.9`,             // legacy: unused when the new one is there
		`vllm:num_requests_waiting{engine="0"} 3 1750000000000`, // a timestamp
		`vllm:num_requests_waiting{engine="1"} NaN`,             // not a finite number: skipped
		`vllm:num_preemptions_total{engine="0"} 7`,
		`vllm:cache_config_info{block_size="16",engine="0",model_name="a}b\"c",num_gpu_blocks="101",enable_prefix_caching="True"} 1`,
		`vllm:cache_config_info{block_size="16",effective_attention_block_size="32",engine="1",kv_cache_size_tokens="4096"} 1`,
		`broken{engine="0" 1`,
		"x " + strings.Repeat("9", MaxLine), // too long: skipped, the rest read
		"vllm:num_requests_waiting 2",
	}, "\n")
	all := Parse(strings.NewReader(page), -1, now)
	assert.Equal(t, time.Unix(1_749_900_000, 0), all.Start)
	assert.InDelta(t, 0.75, all.Usage, 1e-9)
	assert.Equal(t, 2, all.Usages)
	assert.Equal(t, 5, all.Waiting, "3 + 2: NaN and the too-long line skipped")
	require.Len(t, all.Caches, 2)
	assert.Equal(t, Cache{BlockSize: 16, Size: 16, GPUBlocks: 101, PrefixCaching: "True"}, all.Caches[0], "a quoted brace does not end the labels")
	tokens, bs, ok := all.Capacity()
	assert.True(t, ok)
	assert.Equal(t, int64(1600+4096), tokens)
	assert.Equal(t, 16, bs)
	assert.Equal(t, 32, all.Size())
	assert.Empty(t, all.Absurd)

	r0 := Parse(strings.NewReader(page), 0, now)
	assert.InDelta(t, 0.25, r0.Usage, 1e-9)
	assert.Equal(t, 5, r0.Waiting, "rank 0's and the sample without an engine label")
	assert.Len(t, r0.Caches, 1)
	assert.True(t, r0.Preempts)
	assert.Equal(t, 7.0, r0.Preemptions)
}

// TestRefused: a value outside plausible's ranges is noted and leaves its
// figure out whole.
func TestRefused(t *testing.T) {
	page := strings.Join([]string{
		"process_start_time_seconds 4e+09", // in the future
		`vllm:kv_cache_usage_perc{engine="0"} 0.5`,
		`vllm:kv_cache_usage_perc{engine="1"} 7`,
		`vllm:num_requests_waiting{engine="0"} -1`,
		`vllm:num_preemptions_total{engine="0"} 1e300`,
		`vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="100"} 1`,
		`vllm:cache_config_info{block_size="16",engine="1",kv_cache_size_tokens="99999999999999999999"} 1`,
		`vllm:cache_config_info{block_size="64",engine="2",kv_cache_size_tokens="32"} 1`,
	}, "\n")
	p := Parse(strings.NewReader(page), -1, now)
	assert.True(t, p.Start.IsZero())
	assert.True(t, p.BadStart)
	assert.True(t, p.BadUsage)
	assert.True(t, p.BadWaiting)
	assert.False(t, p.Preempts)
	_, _, ok := p.Capacity()
	assert.False(t, ok, "one refused rank: the capacity is unknown")
	assert.Zero(t, p.Size())
	first, ok := p.First()
	assert.True(t, ok)
	assert.Equal(t, 16, first.BlockSize)
	assert.Len(t, p.Absurd, 6, "%q", p.Absurd)
	assert.Contains(t, p.Absurd[5], "below one block of 64")
}

// FuzzParse feeds pages built around a label value nobody listed: the
// parser never fails and, the value escaped as the text format requires,
// reads the labels around it exactly (the oracle is the page's
// construction); any text at all parses without a panic.
func FuzzParse(f *testing.F) {
	f.Add(`m`, "# HELP x\n", 16)
	f.Add(`a"b\c`+"\n", "process_start_time_seconds 1.7e+09\r\n", 64)
	f.Add(`},enable_prefix_caching="False"`, "vllm:cache_config_info{", 1)
	f.Add("\xff\x00", "", 0)
	f.Add(`x`, `vllm:kv_cache_usage_perc{engine="0"} 0.5 123`+"\n", 70000)
	f.Fuzz(func(t *testing.T, value, before string, block int) {
		if block < 0 || block > 1<<20 {
			return
		}
		esc := strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`).Replace(value)
		sample := `vllm:cache_config_info{block_size="` + strconv.Itoa(block) + `",model_name="` + esc +
			`",enable_prefix_caching="True",engine="0"} 1.0`
		page := before + "\n" + sample + "\n"
		p := Parse(strings.NewReader(page), 0, now)
		_ = Parse(strings.NewReader(before+value), -1, now) // anything at all: no panic
		if strings.Contains(before, "vllm:cache_config_info") || len(before) >= MaxLine || len(sample) >= MaxLine {
			return // the page's own lines may hold another sample, or be skipped
		}
		require.Len(t, p.Caches, 1, "page %q", page)
		c := p.Caches[0]
		switch {
		case block < 1 || block > plausible.MaxBlockSize:
			if !c.Bad || len(p.Absurd) == 0 {
				t.Fatalf("page %q: %+v", page, p)
			}
		case c.Bad || c.BlockSize != block || c.Size != block || c.PrefixCaching != "True":
			t.Fatalf("page %q: %+v", page, p)
		}
		got, has := Label([]byte(`model_name="`+esc+`"`), "model_name")
		if !has || got != value {
			t.Fatalf("label %q read as %q (%v)", value, got, has)
		}
	})
}

// TestOffload: the offloading connector's series mark it loaded, a # TYPE
// line alone too (older engines register their labelled series without
// samples until the first transfer); the byte counters are summed over
// ranks, the flat names preferred to the deprecated transfer_type ones
// (current engines export both), which older engines export alone.
func TestOffload(t *testing.T) {
	cases := []struct {
		name        string
		lines       []string
		offload     bool
		store, load float64
	}{
		{name: "no connector", lines: []string{`vllm:kv_cache_usage_perc{engine="0"} 0.1`}},
		{name: "registered, no transfer yet", lines: []string{
			"# HELP vllm:kv_offload_total_bytes Number of bytes offloaded by KV connector",
			"# TYPE vllm:kv_offload_total_bytes counter"}, offload: true},
		{name: "flat and deprecated", lines: []string{
			`vllm:kv_offload_store_bytes_total{engine="0"} 100`,
			`vllm:kv_offload_store_bytes_total{engine="1"} 50`,
			`vllm:kv_offload_load_bytes_total{engine="0"} 30`,
			`vllm:kv_offload_load_bytes_created{engine="0"} 1.7e9`,
			`vllm:kv_offload_total_bytes_total{engine="0",transfer_type="GPU_to_CPU"} 100`,
			`vllm:kv_offload_total_bytes_total{engine="0",transfer_type="CPU_to_GPU"} 30`,
		}, offload: true, store: 150, load: 30},
		{name: "deprecated only", lines: []string{
			`vllm:kv_offload_total_bytes_total{engine="0",transfer_type="GPU_to_CPU"} 64`,
			`vllm:kv_offload_total_bytes_total{engine="0",transfer_type="CPU_to_GPU"} 16`,
			`vllm:kv_offload_load_bytes_total{engine="0"} -5`,
		}, offload: true, store: 64, load: 16},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p := Parse(strings.NewReader(strings.Join(tc.lines, "\n")), -1, now)
			assert.Equal(t, tc.offload, p.Offload)
			assert.Equal(t, tc.store, p.StoreBytes)
			assert.Equal(t, tc.load, p.LoadBytes)
		})
	}
	c := Parse(strings.NewReader(`vllm:cache_config_info{block_size="16",prefix_caching_hash_algo="xxhash"} 1`), -1, now)
	require.Len(t, c.Caches, 1)
	assert.Equal(t, "xxhash", c.Caches[0].HashAlgo)
}
