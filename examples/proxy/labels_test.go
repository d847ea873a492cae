package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// A decode engine that ends each answer with a finish reason of its own
// choosing, and names itself with a version and model of its choosing,
// adds no series: the refusals count under finish_other, its version and
// model under other; finish reasons the APIs define keep their names.
func TestEngineChosenLabelsBounded(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	var n atomic.Int32
	d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		switch r.URL.Path {
		case "/health":
			return
		case "/version":
			_, _ = io.WriteString(w, `{"version":"0.9.0 \u001b[31m`+strings.Repeat("v", 200)+`"}`)
			return
		case "/v1/models":
			_, _ = io.WriteString(w, `{"object":"list","data":[{"id":"model\nwith a line","max_model_len":4096}]}`)
			return
		case "/v1/chat/completions":
		default:
			http.NotFound(w, r)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		finish := fmt.Sprintf("weird-%d", n.Add(1))
		if n.Load() == 1 {
			finish = "abort"
		}
		w.Header().Set("Content-Type", "application/json")
		_, _ = fmt.Fprintf(w, `{"id":"cmpl-1","object":"chat.completion","created":1,"model":"sim-model","choices":[{"index":0,"message":{"role":"assistant","content":"hi"},"finish_reason":%q}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10},"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[[1]],"remote_engine_id":"e","remote_request_id":"r","remote_host":"127.0.0.1","remote_port":5600}}`, finish)
	}))
	t.Cleanup(d.Close)
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", d.URL)
	const turns = 12
	for i := range turns {
		body := fmt.Sprintf(`{"model":"sim-model","messages":[{"role":"user","content":"turn %d"}],"max_tokens":4}`, i)
		status, _, got := p.do(t, http.MethodPost, kvroute.PathChatCompletions, body)
		require.Equal(t, http.StatusOK, status, got)
	}
	var page string
	for range 500 {
		_, _, page = p.do(t, http.MethodGet, "/metrics", "")
		if strings.Contains(page, `bidikv_engine_info{endpoint="`+d.URL) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	assert.Equal(t, "1", metricValue(page, `bidikv_store_refusals_total{reason="finish_abort"}`))
	assert.Equal(t, fmt.Sprint(turns-1), metricValue(page, `bidikv_store_refusals_total{reason="finish_other"}`))
	assert.False(t, strings.Contains(page, "weird"), "an engine's finish reason in a label")
	assert.Equal(t, "1", metricValue(page, `bidikv_engine_info{endpoint="`+d.URL+`",model="other",role="decode",version="other"}`))
	assert.False(t, strings.Contains(page, "vvvv"), "an engine's version in a label")
}

func TestLabelHelpers(t *testing.T) {
	assert.Equal(t, kvroute.PathMessages, pathLabel(kvroute.PathMessages))
	assert.Equal(t, "other", pathLabel("/v1/messages/x"))
	assert.Equal(t, "other", statusLabel(418))
	assert.Equal(t, "503", statusLabel(503))
	assert.Equal(t, "finish_tool_calls", refusalLabel("finish_tool_calls"))
	assert.Equal(t, "finish_other", refusalLabel("finish_Tool Calls"))
	assert.Equal(t, "no_handle", refusalLabel(kvroute.RefuseNoHandle))
	assert.Equal(t, "other", labelShape("a\nb"))
	assert.Equal(t, "meta-llama/Llama-3.1-8B-Instruct", infoLabel("meta-llama/Llama-3.1-8B-Instruct"))
	assert.Equal(t, "0.11.0rc2.dev10+g1234567", infoLabel("0.11.0rc2.dev10+g1234567"))
}
