package sim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

func TestFailNext(t *testing.T) {
	tests := []struct {
		status int
		typ    string
	}{
		{http.StatusServiceUnavailable, "ServiceUnavailableError"},
		{http.StatusInternalServerError, "InternalServerError"},
		{http.StatusBadGateway, "BadGatewayError"},
		{http.StatusTooManyRequests, "TooManyRequestsError"},
	}
	for _, tt := range tests {
		t.Run(tt.typ, func(t *testing.T) {
			reg := sim.NewRegistry()
			p := start(t, reg, nil, nil)
			d := start(t, reg, nil, nil)
			body := chat(msg{"user", words("fail", 80)})
			rd := turnOne(t, p, d, body)
			pinned := d.Stats().BlocksPinned
			p.FailNext(2, tt.status)
			hit := with(chat(msg{"user", words("fail", 80)}, msg{"assistant", rd.Text}, msg{"user", "x"}),
				"max_tokens", 1, "kv_transfer_params", asP(t, rd.KV))
			for i := 0; i < 2; i++ {
				r := post(t, p.url, sim.PathChat, hit)
				require.Equal(t, tt.status, r.Status)
				var eb struct{ Error struct{ Type string } }
				require.NoError(t, json.Unmarshal(r.Body, &eb))
				assert.Equal(t, tt.typ, eb.Error.Type)
			}
			assert.Equal(t, pinned, d.Stats().BlocksPinned, "a failed request consumes nothing")
			assert.Equal(t, http.StatusOK, post(t, p.url, sim.PathChat, hit).Status)
			assert.Zero(t, d.Stats().BlocksPinned)
		})
	}
}

func TestCutStreamAfter(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, nil)
	body := chat(msg{"user", words("cut", 40)})
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	d.CutStreamAfter(2)
	raw, _ := json.Marshal(with(body, "stream", true, "kv_transfer_params", rp.KV))
	resp, err := http.Post(d.url+sim.PathChat, "application/json", bytes.NewReader(raw))
	require.NoError(t, err)
	s := readSSE(t, resp.Body)
	resp.Body.Close()
	assert.Len(t, s.events, 2)
	assert.False(t, s.done, "no [DONE] after a cut")
	st := d.Stats()
	assert.Equal(t, 1, st.Aborted)
	assert.Zero(t, st.BlocksPinned, "aborted: no handle kept")

	// Only the next stream is cut.
	s2, _ := stream(t, d.url, with(chat(msg{"user", "again"}), "stream", true))
	assert.True(t, s2.done)
}

func TestStallAbortsWhenClientLeaves(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, nil)
	body := chat(msg{"user", words("stall", 40)})
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	d.Stall(time.Hour)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan result, 1)
	go func() { done <- postCtx(t, ctx, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV)) }()
	// The read from P happens before the stall.
	require.Eventually(t, func() bool { return p.Stats().TokensPulledOut > 0 }, 10*time.Second, time.Millisecond)
	cancel()
	assert.Equal(t, -1, (<-done).Status)
	require.Eventually(t, func() bool { return d.Stats().Aborted == 1 }, 10*time.Second, time.Millisecond)
	assert.Zero(t, d.Stats().BlocksPinned)
	assert.Equal(t, 499, lastRecord(d).Status)
}

func TestStallDelaysOnce(t *testing.T) {
	e := start(t, nil, nil, nil)
	e.Stall(time.Millisecond)
	assert.Equal(t, http.StatusOK, post(t, e.url, sim.PathChat, chat(msg{"user", "a"})).Status)
	assert.Equal(t, http.StatusOK, post(t, e.url, sim.PathChat, chat(msg{"user", "b"})).Status)
	assert.Zero(t, e.Stats().Aborted)
}

// After a restart the old handle names an engine that no longer exists: the
// read fails (policy fail: vLLM's 500).
func TestRestartLosesBlocks(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, nil)
	body := chat(msg{"user", words("restart", 40)})
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	oldID := p.EngineID()
	host, port := p.SideChannel()
	p.Restart()
	assert.NotEqual(t, oldID, p.EngineID())
	h2, p2 := p.SideChannel()
	assert.Equal(t, host, h2)
	assert.Equal(t, port, p2)
	st := p.Stats()
	assert.Zero(t, st.BlocksPinned)
	assert.Equal(t, 1, st.Restarts)

	rd := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV))
	assert.Equal(t, http.StatusInternalServerError, rd.Status)
	assert.Equal(t, 1, d.Stats().LoadFailures)
	assert.Zero(t, d.Stats().BlocksPinned)
}

// With an engine id fixed in its configuration, a restarted engine is
// reached under the old handle's id, and the read returns whatever its
// new process holds in those block ids: the reader's answer is wrong,
// with no error. GET /metrics shows the new process_start_time_seconds.
func TestRestartWithFixedEngineID(t *testing.T) {
	reg := sim.NewRegistry()
	clk := newClock()
	p := start(t, reg, clk, func(c *sim.Config) { c.EngineID = "p-fixed" })
	d := start(t, reg, clk, nil)
	body := chat(msg{"user", words("restart", 40)})
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	before := metricsStart(t, p.url)
	assert.Equal(t, p.StartTime().Unix(), int64(before))
	clk.Advance(90 * time.Second)
	p.Restart()
	assert.Equal(t, "p-fixed", p.EngineID(), "a fixed engine id survives the restart")
	after := metricsStart(t, p.url)
	assert.InDelta(t, before+90, after, 0.001, "process_start_time_seconds moves to the new process's start")
	// The new process serves another conversation in the same block ids.
	post(t, p.url, sim.PathChat, with(chat(msg{"user", words("other", 40)}), "max_tokens", 1, "kv_transfer_params", missHandle()))

	rd := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV))
	require.Equal(t, http.StatusOK, rd.Status, "the read succeeds")
	assert.NotEqual(t, reference(t, sim.PathChat, body).Content, rd.Text, "with other content")
	assert.Equal(t, 1, d.Stats().WrongOutputs)
	assert.Equal(t, 1, p.Stats().FreedReads, "a read of blocks the new process does not hold for it")
}

// metricsStart reads process_start_time_seconds from GET /metrics.
func metricsStart(t *testing.T, url string) float64 {
	t.Helper()
	resp, err := http.Get(url + "/metrics")
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "process_start_time_seconds "); ok {
			f, err := strconv.ParseFloat(v, 64)
			require.NoError(t, err)
			return f
		}
	}
	t.Fatalf("no process_start_time_seconds in %s", b)
	return 0
}

// A handle naming a side channel no engine serves is a load failure; with
// kv_load_failure_policy=recompute the request is served from scratch.
func TestUnreachableSideChannel(t *testing.T) {
	for _, policy := range []string{sim.PolicyFail, sim.PolicyRecompute} {
		t.Run(policy, func(t *testing.T) {
			p := start(t, nil, nil, nil)
			d := start(t, nil, nil, func(c *sim.Config) { c.KVLoadFailurePolicy = policy }) // another registry
			body := chat(msg{"user", words("far", 40)})
			rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
			rd := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV))
			assert.Equal(t, 1, d.Stats().LoadFailures)
			if policy == sim.PolicyFail {
				assert.Equal(t, http.StatusInternalServerError, rd.Status)
				return
			}
			require.Equal(t, http.StatusOK, rd.Status)
			assert.Equal(t, reference(t, sim.PathChat, body).Content, rd.Text)
			assert.NotNil(t, rd.KV, "D still emits its handle")
		})
	}
}

// A rewritten remote_host (the reference proxy's bug) makes the read fail.
func TestRewrittenHostFails(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, nil)
	d := start(t, reg, nil, nil)
	body := chat(msg{"user", words("host", 40)})
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	h := decodeHandle(t, rp.KV)
	h["remote_host"] = strings.TrimPrefix(strings.Split(p.url, ":")[1], "//")
	rd := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", h))
	assert.Equal(t, http.StatusInternalServerError, rd.Status)
	assert.Equal(t, 1, d.Stats().LoadFailures)
}
