package main

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
)

func scrape(t *testing.T, m *metrics) string {
	t.Helper()
	rec := httptest.NewRecorder()
	m.handler().ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	require.Equal(t, http.StatusOK, rec.Code)
	return rec.Body.String()
}

// A request the router rejects before lookup is counted as rejected, not
// as a turn or a miss, whether the router reports it with Reuse "" or
// (older routers) "miss"; the hit ratio counts only turns that reached
// lookup.
func TestRejectedTurnsAreNotMisses(t *testing.T) {
	m := newMetrics()
	assert.Equal(t, "NaN", metricValue(scrape(t, m), "bidikv_reuse_hit_ratio"), "no turn yet")

	bad := fmt.Errorf("%w: request body is not JSON", kvroute.ErrBadRequest)
	for _, reuse := range []kvroute.ReuseOutcome{"", kvroute.ReuseMiss, kvroute.ReuseOff} {
		m.observe(&kvroute.TurnRecord{Path: kvroute.PathChatCompletions, Reuse: reuse, Err: bad, ErrPhase: kvroute.PhaseLookup})
	}
	m.observe(&kvroute.TurnRecord{Path: kvroute.PathChatCompletions, Reuse: "", Err: bad})
	m.observe(&kvroute.TurnRecord{Path: kvroute.PathChatCompletions, Reuse: kvroute.ReuseMiss, Err: kvroute.ErrClosed, ErrPhase: kvroute.PhaseLookup})
	page := scrape(t, m)
	assert.Equal(t, "4", metricValue(page, `bidikv_rejected_requests_total{reason="bad_request",status="400"}`))
	assert.Equal(t, "1", metricValue(page, `bidikv_rejected_requests_total{reason="closed",status="503"}`))
	assert.NotContains(t, page, "bidikv_turns_total{")
	assert.NotContains(t, page, "bidikv_reuse_misses_total{")
	assert.NotContains(t, page, "bidikv_turn_errors_total{")
	assert.Equal(t, "NaN", metricValue(page, "bidikv_reuse_hit_ratio"))

	m.observe(&kvroute.TurnRecord{Path: kvroute.PathChatCompletions, Reuse: kvroute.ReuseMiss, MissReason: kvroute.MissNoKey})
	m.observe(&kvroute.TurnRecord{Path: kvroute.PathChatCompletions, Reuse: kvroute.ReuseHit})
	m.observe(&kvroute.TurnRecord{Path: kvroute.PathChatCompletions, Reuse: kvroute.ReuseHit})
	// A turn that missed and then failed upstream reached lookup: a miss.
	m.observe(&kvroute.TurnRecord{Path: kvroute.PathChatCompletions, Reuse: kvroute.ReuseMiss, MissReason: kvroute.MissNotFound,
		Err: &kvroute.UpstreamError{Phase: kvroute.PhasePrefill}, ErrPhase: kvroute.PhasePrefill})
	page = scrape(t, m)
	assert.Equal(t, "0.5", metricValue(page, "bidikv_reuse_hit_ratio"))
	assert.Equal(t, "1", metricValue(page, `bidikv_turns_total{path="/v1/chat/completions",result="error",reuse="miss"}`))
	assert.Equal(t, "1", metricValue(page, `bidikv_reuse_misses_total{reason="no_key"}`))
	assert.Equal(t, "1", metricValue(page, `bidikv_turn_errors_total{phase="prefill"}`))
}

// Through the proxy: a malformed body is a rejected request, not a miss.
func TestBadRequestMetrics(t *testing.T) {
	p := startInProcess(t, nil)
	status, h, body := p.do(t, http.MethodPost, "/v1/chat/completions", `{"model":`)
	assert.Equal(t, http.StatusBadRequest, status, body)
	assert.Equal(t, "application/json", h.Get("Content-Type"))
	_, _, page := p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "1", metricValue(page, `bidikv_rejected_requests_total{reason="bad_request",status="400"}`))
	assert.NotContains(t, page, "bidikv_turns_total{")
	assert.NotContains(t, page, `bidikv_reuse_misses_total{`)
	assert.Equal(t, "NaN", metricValue(page, "bidikv_reuse_hit_ratio"))
}

// The cost model's decisions by path and the KV each decode engine holds
// are exported, one series per path and per decode engine.
func TestDecodeLocalMetrics(t *testing.T) {
	r, err := kvroute.New(kvroute.WithPrefill("http://127.0.0.1:9"), kvroute.WithDecode("http://127.0.0.1:10"),
		kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true, KVBytesPerToken: 262144}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	m := newMetrics()
	m.watchRouter(r)
	page := scrape(t, m)
	for _, p := range []string{"pull", "decode_local", "recompute"} {
		assert.Equal(t, "0", metricValue(page, fmt.Sprintf(`bidikv_path_decisions_total{path=%q}`, p)), p)
	}
	assert.Equal(t, "0", metricValue(page, `bidikv_decode_kv_held_tokens{endpoint="http://127.0.0.1:10"}`))
	assert.Equal(t, "0", metricValue(page, `bidikv_decode_kv_held_bytes{endpoint="http://127.0.0.1:10"}`))
	assert.Equal(t, "0", metricValue(page, "bidikv_decode_local_busy_total"))
	assert.Equal(t, "0", metricValue(page, "bidikv_cpu_tier_local_short_total"), "decode-local reloads that fell short")
}
