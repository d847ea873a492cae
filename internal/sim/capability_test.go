package sim_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// GET /metrics as vLLM's PrometheusStatLogger writes it (vllm/v1/metrics/
// loggers.py): per-engine gauges labelled model_name and engine, the
// preemption counter, and vllm:cache_config_info, an info gauge whose
// labels are CacheConfig.metrics_info() and engine.
func TestMetricsValues(t *testing.T) {
	reg, clk := sim.NewRegistry(), newEventClock()
	p := start(t, reg, clk, noCache)
	d := start(t, reg, clk, func(c *sim.Config) { c.NumBlocks = 8; c.PrefixCaching = false })

	info := metricLabels(t, d.url, "vllm:cache_config_info")
	assert.Equal(t, "1.0", info[""])
	assert.Equal(t, "9", info["num_gpu_blocks"], "vLLM counts its null block")
	assert.Equal(t, "16", info["block_size"])
	assert.Equal(t, "False", info["enable_prefix_caching"])
	assert.Equal(t, "128", info["kv_cache_size_tokens"])
	assert.Equal(t, "0.9", info["gpu_memory_utilization"])
	assert.Equal(t, "0", info["engine"])
	assert.Equal(t, "8193", metricLabels(t, p.url, "vllm:cache_config_info")["num_gpu_blocks"])
	caching := start(t, nil, nil, nil)
	assert.Equal(t, "True", metricLabels(t, caching.url, "vllm:cache_config_info")["enable_prefix_caching"])

	running := metricLabels(t, d.url, "vllm:num_requests_running")
	assert.Equal(t, "sim-model", running["model_name"])
	assert.Equal(t, "0", running["engine"])
	assert.Equal(t, "0.0", running[""])
	assert.Equal(t, "0.0", metricLabels(t, d.url, "vllm:kv_cache_usage_perc")[""])

	hold(t, p, d, idPrompt(1, 64), 17) // 5 of 8 blocks
	assert.Equal(t, "0.625", metricLabels(t, d.url, "vllm:kv_cache_usage_perc")[""])
	r := async(t.Context(), clk, d.url, ids(idPrompt(2, 64), 1, nil))
	settle(t, clk, 1)
	assert.Equal(t, 1, metric(t, d.url, "vllm:num_requests_waiting"))
	assert.Equal(t, 0, metric(t, d.url, "vllm:num_requests_running"))
	assert.Equal(t, 0, metric(t, d.url, "vllm:num_preemptions_total"))
	assert.Nil(t, metricLabels(t, d.url, "vllm:gpu_cache_usage_perc"), "the old name is gone")
	run(t, clk)
	require.Equal(t, http.StatusOK, (<-r).Status)
	assert.Equal(t, 0, metric(t, d.url, "vllm:num_requests_waiting"))
	assert.Equal(t, "0.0", metricLabels(t, d.url, "vllm:kv_cache_usage_perc")[""], "the TTL freed the hold; caching off")

	body := getBody(t, d.url+"/metrics")
	assert.Contains(t, body, "# TYPE vllm:num_preemptions_total counter\n")
	assert.Contains(t, body, "vllm:num_requests_running{model_name=\"sim-model\",engine=\"0\"} 0.0\n")
	assert.Contains(t, body, "# TYPE process_start_time_seconds gauge\n")
}

// The KV usage gauge's name: vllm:kv_cache_usage_perc since vLLM 0.9,
// vllm:gpu_cache_usage_perc before, both (the old one deprecated) in 0.9
// and 0.10; and one sample per data-parallel rank.
func TestMetricsUsageNames(t *testing.T) {
	for _, tt := range []struct {
		mode            string
		current, legacy bool
	}{
		{"", true, false},
		{sim.UsageMetricCurrent, true, false},
		{sim.UsageMetricLegacy, false, true},
		{sim.UsageMetricBoth, true, true},
	} {
		t.Run(tt.mode, func(t *testing.T) {
			e := start(t, nil, nil, func(c *sim.Config) { c.UsageMetric = tt.mode; c.DPSize = 2 })
			body := getBody(t, e.url+"/metrics")
			for name, want := range map[string]bool{"vllm:kv_cache_usage_perc": tt.current, "vllm:gpu_cache_usage_perc": tt.legacy} {
				assert.Equal(t, want, strings.Contains(body, name+"{"), name)
				if want {
					assert.Contains(t, body, name+`{model_name="sim-model",engine="1"} 0.0`)
				}
			}
			assert.Equal(t, 2, strings.Count(body, "vllm:cache_config_info{"))
		})
	}
	_, err := sim.New(func() sim.Config { c := sim.DefaultConfig(); c.UsageMetric = "old"; return c }())
	assert.ErrorIs(t, err, sim.ErrInvalidConfig)
}

func getBody(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// GET /version answers {"version": ...} compactly, as vLLM's api_server
// show_version does; without a version the route is not there.
func TestVersionRoute(t *testing.T) {
	e := start(t, nil, nil, nil)
	resp, err := http.Get(e.url + "/version")
	require.NoError(t, err)
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, `{"version":"`+sim.DefaultVersion+`"}`, string(b))

	custom := start(t, nil, nil, func(c *sim.Config) { c.Version = "0.9.2" })
	assert.Equal(t, `{"version":"0.9.2"}`, getBody(t, custom.url+"/version"))

	none := start(t, nil, nil, func(c *sim.Config) { c.Version = "" })
	resp, err = http.Get(none.url + "/version")
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusNotFound, resp.StatusCode)
}

// POST /tokenize present by default, 404 without it.
func TestTokenizeAbsent(t *testing.T) {
	body := map[string]any{"model": "sim-model", "prompt": "hello"}
	assert.Equal(t, http.StatusOK, postAPIRaw(t, start(t, nil, nil, nil).url, sim.PathTokenize, body).Status)
	e := start(t, nil, nil, func(c *sim.Config) { c.NoTokenize = true })
	r := postAPIRaw(t, e.url, sim.PathTokenize, body)
	assert.Equal(t, http.StatusNotFound, r.Status)
	assert.JSONEq(t, `{"detail":"Not Found"}`, string(r.Body))
	assert.Zero(t, e.Stats().TokenizeRequests)
}

// An engine older than PR #37424 (Responses) or #37535 (Messages) has no
// kv_transfer_params in the API's request model: the field is ignored (a
// plain request: no read, no hold) and the response has no such key.
func TestAPIsWithoutKVTransferParams(t *testing.T) {
	for _, path := range []string{sim.PathResponses, sim.PathMessages} {
		for _, off := range []bool{false, true} {
			t.Run(path+map[bool]string{false: "/accepted", true: "/ignored"}[off], func(t *testing.T) {
				p := start(t, nil, nil, func(c *sim.Config) {
					c.NoResponsesKV = off && path == sim.PathResponses
					c.NoMessagesKV = off && path == sim.PathMessages
				})
				maxKey := "max_tokens"
				if path == sim.PathResponses {
					maxKey = "max_output_tokens"
				}
				body := with(apiBody(path, []map[string]any{userTurn(path, words("older", 40))}), maxKey, 1, "kv_transfer_params", missHandle())
				r := postAPIRaw(t, p.url, path, body)
				require.Equal(t, http.StatusOK, r.Status, string(r.Body))
				var m map[string]json.RawMessage
				require.NoError(t, json.Unmarshal(r.Body, &m))
				kv, present := m["kv_transfer_params"]
				rec := lastRecord(p)
				if off {
					assert.False(t, present, "no such key")
					assert.Equal(t, sim.RolePlain, rec.Role)
					assert.Zero(t, p.Stats().BlocksPinned)
					return
				}
				assert.True(t, present)
				assert.NotEqual(t, "null", string(kv))
				assert.Equal(t, sim.RolePrefill, rec.Role)
				assert.Positive(t, p.Stats().BlocksPinned)
			})
		}
	}
}

// A request longer than max_model_len (NumBlocks × BlockSize: what the KV
// pool holds) is rejected as vLLM's serving layer does, before it reaches
// the scheduler; without max_tokens generation stops at max_model_len.
func TestContextLength(t *testing.T) {
	e := start(t, nil, nil, func(c *sim.Config) { c.NumBlocks = 4 }) // 64 tokens
	r := post(t, e.url, sim.PathCompletions, map[string]any{"model": "sim-model", "prompt": idPrompt(1, 64)})
	assert.Equal(t, http.StatusBadRequest, r.Status)
	assert.Contains(t, string(r.Body), "maximum context length is 64 tokens")
	r = post(t, e.url, sim.PathCompletions, ids(idPrompt(1, 60), 5, nil))
	assert.Equal(t, http.StatusBadRequest, r.Status)
	assert.Contains(t, string(r.Body), "(60 in the messages, 5 in the completion)")
	r = post(t, e.url, sim.PathCompletions, map[string]any{"model": "sim-model", "prompt": idPrompt(1, 60), "ignore_eos": true})
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	assert.Equal(t, "length", r.Finish)
	assert.Equal(t, 4, r.Complete, "stopped at max_model_len")
	assert.Zero(t, e.Stats().Errors-2)
}

// --max-model-len below the pool: GET /v1/models lists it, and vLLM's
// serving layer rejects a request whose prompt plus max_tokens (chat:
// max_completion_tokens when given) exceeds it with 400
// (vllm/renderers/params.py, TokenizeParams._token_len_check); generation
// without max_tokens stops at it.
func TestMaxModelLen(t *testing.T) {
	e := start(t, nil, nil, func(c *sim.Config) { c.NumBlocks, c.MaxModelLen = 8, 64 }) // a pool of 128 tokens
	resp, err := http.Get(e.url + "/v1/models")
	require.NoError(t, err)
	var models struct {
		Data []struct {
			MaxModelLen int `json:"max_model_len"`
		} `json:"data"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&models))
	resp.Body.Close()
	require.Len(t, models.Data, 1)
	assert.Equal(t, 64, models.Data[0].MaxModelLen)
	r := post(t, e.url, sim.PathCompletions, ids(idPrompt(1, 60), 5, nil))
	assert.Equal(t, http.StatusBadRequest, r.Status)
	assert.Contains(t, string(r.Body), "maximum context length is 64 tokens")
	r = post(t, e.url, sim.PathCompletions, ids(idPrompt(1, 60), 4, nil))
	assert.Equal(t, http.StatusOK, r.Status, string(r.Body))
	chat := map[string]any{"model": "sim-model", "messages": []map[string]any{{"role": "user", "content": "hi"}},
		"max_tokens": 8, "max_completion_tokens": 1 << 20}
	r = post(t, e.url, sim.PathChat, chat)
	assert.Equal(t, http.StatusBadRequest, r.Status, "max_completion_tokens rules")
	r = post(t, e.url, sim.PathCompletions, map[string]any{"model": "sim-model", "prompt": idPrompt(1, 60), "ignore_eos": true})
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	assert.Equal(t, 4, r.Complete, "stopped at max_model_len")
	_, err = sim.New(func() sim.Config { c := sim.DefaultConfig(); c.NumBlocks, c.MaxModelLen = 4, 65; return c }())
	assert.ErrorIs(t, err, sim.ErrInvalidConfig, "max_model_len over the pool")
}

// --max-num-seqs: beyond it requests wait though blocks are free.
func TestMaxNumSeqs(t *testing.T) {
	clk := newEventClock()
	e := start(t, nil, clk, func(c *sim.Config) { c.MaxNumSeqs = 1; c.Profile = ms })
	ctx := t.Context()
	a, b := idPrompt(1, 32), idPrompt(2, 32)
	ra := async(ctx, clk, e.url, ids(a, 4, nil))
	settle(t, clk, 1)
	rb := async(ctx, clk, e.url, ids(b, 4, nil))
	settle(t, clk, 2)
	assert.Equal(t, 1, e.Stats().Running)
	assert.Equal(t, 1, e.Stats().Waiting)
	run(t, clk)
	require.Equal(t, http.StatusOK, (<-ra).Status)
	require.Equal(t, http.StatusOK, (<-rb).Status)
	recA := recordOf(t, e, a)
	assert.Equal(t, recA.Prefill+recA.Decode, recordOf(t, e, b).Queued, "b waited for a to finish")
}
