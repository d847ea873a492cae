package main

import (
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Issue 24, item 3, end to end: engines as stock vLLM serves them (no
// handle in chat or Messages streams) and the proxy with --decode-stream
// buffered. Claude Code-shaped streamed /v1/messages sessions reuse KV from
// turn 2 on, each answer the single engine's and a stream the client reads
// to message_stop; no handle byte reaches the client; the buffered turns
// are counted per API. (Without the flag, every such turn misses:
// TestE2EAgents.)
func TestE2EBufferedStreams(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	t.Parallel() // slow: real processes
	p := start(t, "vllmsim", simReady, "--port", "0", "--side-channel-port", "0", "--kv-transfer-config", kvConfig, "--no-enable-prefix-caching")
	d := start(t, "vllmsim", simReady, "--port", "0", "--side-channel-port", "0", "--kv-transfer-config", kvConfig)
	px := startProxy(t, p, d, "--decode-stream", "buffered")
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)

	const turns = 5
	for _, c := range []agentClient{
		{path: "/v1/messages", query: "?beta=true", stream: true, base: claudeBody("buffered"), session: "buffered"},
	} {
		t.Run(c.path, func(t *testing.T) {
			runAgentTurns(t, &c, client, px.url, c.session, turns, true)
		})
	}
	status, page := get(t, px.url+"/metrics")
	require.Equal(t, http.StatusOK, status)
	for sample, want := range map[string]string{
		`bidikv_buffered_streams_total{path="/v1/messages"}`:                                   fmt.Sprint(turns),
		`bidikv_turns_total{path="/v1/messages",result="ok",reuse="hit"}`:                      fmt.Sprint(turns - 1),
		`bidikv_missing_capability_turns_total{path="/v1/messages",reason="no_stream_handle"}`: "absent",
		`bidikv_store_refusals_total{reason="no_stream_handle"}`:                               "absent",
		`bidikv_inflight_turns`: "0",
	} {
		assert.Equal(t, want, metricValue(page, sample), sample)
	}
	assert.Contains(t, px.stderr.String(), "buffered streams", "the trade is logged at start-up")
}

// Buffered streams through the proxy pass the hostile-engine leak suite.
func TestHostileBufferedThroughProxy(t *testing.T) {
	e := kvroutetest.NewHostileEngine(t, kvroutetest.HostileAnswer{})
	p := startInProcess(t, nil, "--prefill", e.URL(), "--decode", e.URL(), "--decode-stream", "buffered")
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	t.Cleanup(client.CloseIdleConnections)
	kvroutetest.TestHostileBuffered(t, e, p.url, client)
}
