package sim_test

import (
	"context"
	"net/http"
	"net/http/httptest"
	"net/url"
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

// remote starts an engine alone in its registry whose side channel is served
// over HTTP on 127.0.0.1 and which reaches other side channels over HTTP.
func remote(t *testing.T, mod func(*sim.Config)) *node {
	t.Helper()
	side := httptest.NewUnstartedServer(nil)
	u, err := url.Parse("http://" + side.Listener.Addr().String())
	require.NoError(t, err)
	port, _ := strconv.Atoi(u.Port())
	reg := sim.NewRegistry()
	reg.Dial = sim.HTTPDialer(&http.Client{})
	n := start(t, reg, nil, func(c *sim.Config) {
		c.SideHost, c.SidePort = u.Hostname(), port
		if mod != nil {
			mod(c)
		}
	})
	side.Config.Handler = sim.SideChannelHandler(n.Engine)
	side.Start()
	t.Cleanup(side.Close)
	return n
}

func TestHTTPSideChannel(t *testing.T) {
	p := remote(t, noCache)
	d := remote(t, nil)
	first := chat(msg{"user", words("wire", 100)})
	rd := turnOne(t, p, d, first)
	assert.Equal(t, reference(t, sim.PathChat, first).Content, rd.Text)
	assert.Zero(t, p.Stats().BlocksPinned, "notify crossed the wire")
	second := chat(msg{"user", words("wire", 100)}, msg{"assistant", rd.Text}, msg{"user", words("next", 30)})
	rp := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV)))
	require.Equal(t, http.StatusOK, rp.Status, string(rp.Body))
	assert.Equal(t, sim.PullRead, lastRecord(p).Pull)
	assert.Zero(t, d.Stats().BlocksPinned)
	rd2 := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", rp.KV))
	require.Equal(t, http.StatusOK, rd2.Status)
	assert.Equal(t, reference(t, sim.PathChat, second).Content, rd2.Text)

	// A restarted emitter answers the read with an engine id mismatch.
	rp3 := post(t, p.url, sim.PathChat, with(second, "max_tokens", 1, "kv_transfer_params", missHandle()))
	p.Restart()
	r := post(t, d.url, sim.PathChat, with(second, "kv_transfer_params", rp3.KV))
	assert.Equal(t, http.StatusInternalServerError, r.Status)
}

func TestUnidirectional(t *testing.T) {
	reg := sim.NewRegistry()
	oneWay := func(c *sim.Config) { c.Bidirectional = false }
	p := start(t, reg, nil, oneWay)
	d := start(t, reg, nil, oneWay)
	body := chat(msg{"user", words("oneway", 50)})
	rp := post(t, p.url, sim.PathChat, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.NotNil(t, rp.KV, "P still hands off to D")
	rd := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV))
	require.Equal(t, http.StatusOK, rd.Status)
	assert.Nil(t, rd.KV, "no D handle")
	assert.Zero(t, d.Stats().BlocksPinned)
}

// A heartbeat over the HTTP side channel renews P's lease from then on;
// a heartbeat for D's hold (on the TTL) or an unknown request changes
// nothing.
func TestHTTPHeartbeat(t *testing.T) {
	clk := newClock()
	p := remote(t, func(c *sim.Config) { c.Clock = clk })
	rp := post(t, p.url, sim.PathChat, with(chat(msg{"user", words("beat", 60)}), "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.NotNil(t, rp.KV)
	h, err := sim.ParseParams(rp.KV)
	require.NoError(t, err)
	peer := sim.HTTPDialer(&http.Client{})(h.Host, h.Port)
	ctx := context.Background()
	clk.Advance(25 * time.Second)
	require.NoError(t, peer.Heartbeat(ctx, h.EngineID, h.RequestID))
	require.NoError(t, peer.Heartbeat(ctx, h.EngineID, "no-such-request"))
	assert.ErrorIs(t, peer.Heartbeat(ctx, "other-engine", h.RequestID), sim.ErrEngineID)
	clk.Advance(25 * time.Second)
	assert.Positive(t, p.Stats().BlocksPinned, "50 s after: renewed at 25 s")
	clk.Advance(6 * time.Second)
	assert.Zero(t, p.Stats().BlocksPinned, "the renewed lease ran out")
	assert.Equal(t, 1, p.Stats().LeaseExpiries)
}
