package main

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// metricsFront fronts engine e: every path reaches e, but /metrics is
// answered by page (what the test wants the router to read).
func metricsFront(t *testing.T, e *kvroutetest.Engine, page func(w http.ResponseWriter)) string {
	t.Helper()
	u, err := url.Parse(e.URL())
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			rp.ServeHTTP(w, r)
			return
		}
		page(w)
	}))
	t.Cleanup(srv.Close)
	return srv.URL
}

// hostileMetricsFront fronts an engine whose /metrics reports a process
// start a day ahead and a block count whose capacity overflows int64.
func hostileMetricsFront(t *testing.T, e *kvroutetest.Engine) string {
	return metricsFront(t, e, func(w http.ResponseWriter) {
		fmt.Fprintf(w, "process_start_time_seconds %d\n", time.Now().Add(24*time.Hour).Unix())
		fmt.Fprintln(w, `vllm:cache_config_info{block_size="8",enable_prefix_caching="True",engine="0",num_gpu_blocks="2305843009213693954"} 1.0`)
	})
}

// An engine's implausible /metrics values are reported, not acted on: the
// doctor names them as a gap, /metrics counts them (the capability probe's
// per engine, the router's readings in total), and the conversation's
// second turn still reuses.
func TestImplausibleEngineMetricsReported(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	d := hostileMetricsFront(t, cl.Decode[0])

	stdout := &syncBuffer{}
	_ = run(context.Background(), []string{"doctor", "--prefill", cl.Prefill[0].URL(), "--decode", d}, noEnv, stdout, &syncBuffer{})
	out := stdout.String()
	assert.True(t, strings.Contains(out, "warn: decode engine "+d+": its /metrics reports values no real engine does (process_start_time_seconds="), "the doctor's gap")
	assert.True(t, strings.Contains(out, `num_gpu_blocks="2305843009213693954" (above 2147483647)`), "the value")

	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", d, "--recompute-threshold", "0")
	body := `{"model":"sim-model","messages":[{"role":"user","content":"first"}],"max_tokens":8}`
	status, _, got := p.do(t, http.MethodPost, "/v1/chat/completions", body)
	require.Equal(t, http.StatusOK, status, got)
	reply := chatContent(t, got)
	body2 := fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":"first"},{"role":"assistant","content":%q},{"role":"user","content":"second"}],"max_tokens":8}`, reply)
	status, h, got := p.do(t, http.MethodPost, "/v1/chat/completions", body2)
	require.Equal(t, http.StatusOK, status, got)
	assert.Equal(t, "hit", h.Get("X-Bidikv-Reuse"), "the restart check ignored the start in the future")
	assert.Equal(t, reference(t, []byte(body2)), chatContent(t, got))
	waitMetric(t, p, "bidikv_implausible_engine_metrics_total", func(v int) bool { return v >= 1 })
	waitMetric(t, p, `bidikv_engine_implausible_metrics{endpoint="`+d+`",role="decode"}`, func(v int) bool { return v == 2 })
}

// chatContent is the content of a chat answer's first choice.
func chatContent(t *testing.T, body string) string {
	t.Helper()
	var resp struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &resp), body)
	require.NotEmpty(t, resp.Choices)
	return resp.Choices[0].Message.Content
}
