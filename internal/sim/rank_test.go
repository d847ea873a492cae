package sim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

func dp(n int) func(*sim.Config) { return func(c *sim.Config) { c.DPSize = n } }

// postRank posts body with X-data-parallel-rank: rank (no header when rank
// is "") under the header name hdr.
func postRank(t *testing.T, url, path, hdr, rank string, body any) result {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := http.NewRequest(http.MethodPost, url+path, bytes.NewReader(raw))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	if rank != "" {
		req.Header[hdr] = []string{rank} // the name as written, not canonicalised
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	res := result{Status: resp.StatusCode, Body: b}
	if resp.StatusCode == http.StatusOK && !bytes.HasPrefix(b, []byte("data:")) {
		var parsed struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
			} `json:"choices"`
			Usage struct {
				PromptTokens     int `json:"prompt_tokens"`
				CompletionTokens int `json:"completion_tokens"`
			} `json:"usage"`
			KV json.RawMessage `json:"kv_transfer_params"`
		}
		require.NoError(t, json.Unmarshal(b, &parsed), string(b))
		res.Text = parsed.Choices[0].Message.Content
		res.Prompt, res.Complete = parsed.Usage.PromptTokens, parsed.Usage.CompletionTokens
		if string(parsed.KV) != "null" {
			res.KV = parsed.KV
		}
	}
	return res
}

func pinned(t *testing.T, url, rank string, body any) result {
	t.Helper()
	r := postRank(t, url, sim.PathChat, sim.RankHeader, rank, body)
	require.Equal(t, http.StatusOK, r.Status, string(r.Body))
	return r
}

// Each rank emits handles with its own engine id and side-channel port.
func TestDPRanksHaveOwnEngineIDsAndPorts(t *testing.T) {
	p := start(t, sim.NewRegistry(), nil, dp(2))
	require.Equal(t, 2, p.DPSize())
	host, base := p.SideChannel()
	id0, id1 := p.RankEngineID(0), p.RankEngineID(1)
	assert.NotEqual(t, id0, id1)
	assert.True(t, strings.HasSuffix(id0, "_dp0"), id0)
	assert.Equal(t, strings.TrimSuffix(id0, "_dp0")+"_dp1", id1, "vLLM's <engine_id>_dp<rank>")
	assert.Equal(t, id0, p.EngineID())

	body := with(chat(msg{"user", words("ranks", 40)}), "max_tokens", 1, "kv_transfer_params", missHandle())
	var hs []map[string]any
	for range 2 { // round-robin: rank 0, then rank 1
		r := post(t, p.url, sim.PathChat, body)
		require.Equal(t, http.StatusOK, r.Status, string(r.Body))
		require.NotNil(t, r.KV)
		hs = append(hs, decodeHandle(t, r.KV))
	}
	for k, h := range hs {
		assert.Equal(t, p.RankEngineID(k), h["remote_engine_id"], "rank %d", k)
		assert.Equal(t, host, h["remote_host"])
		assert.EqualValues(t, base+k, h["remote_port"], "base + data-parallel index")
		_, port := p.RankSideChannel(k)
		assert.Equal(t, base+k, port)
		assert.Equal(t, k, p.Records()[k].Rank)
	}
	// Two pools: the same prompt on rank 1 found nothing cached by rank 0.
	assert.Zero(t, p.Records()[1].CachedTokens)
	st := p.Stats()
	blocks := len(hs[0]["remote_block_ids"].([]any)[0].([]any))
	assert.Equal(t, 2*blocks, st.BlocksPinned, "pinned blocks summed over ranks")
	assert.Equal(t, 2*8192-2*blocks, st.FreeBlocks, "each rank has its own pool")
	assert.Equal(t, 2, st.HandlesEmitted)

	p.Restart()
	assert.NotEqual(t, id0, p.RankEngineID(0))
	assert.True(t, strings.HasSuffix(p.RankEngineID(1), "_dp1"))
	assert.Zero(t, p.Stats().BlocksPinned)
}

// One rank keeps the unsuffixed engine id and the one side channel.
func TestDPOneRankUnchanged(t *testing.T) {
	reg := sim.NewRegistry()
	e := start(t, reg, nil, nil)
	assert.Equal(t, 1, e.DPSize())
	assert.NotContains(t, e.EngineID(), "_dp")
	host, port := e.SideChannel()
	assert.Nil(t, reg.Lookup(host, port+1))
	assert.Same(t, e.Engine, reg.Lookup(host, port))
	// The header is ignored without StrictRank.
	r := postRank(t, e.url, sim.PathChat, sim.RankHeader, "3", chat(msg{"user", "hi"}))
	assert.Equal(t, http.StatusOK, r.Status, string(r.Body))

	strict := start(t, reg, nil, func(c *sim.Config) { c.StrictRank = true })
	r = postRank(t, strict.url, sim.PathChat, sim.RankHeader, "1", chat(msg{"user", "hi"}))
	assert.Equal(t, http.StatusBadRequest, r.Status)
	assert.Contains(t, string(r.Body), "data_parallel_rank 1 is out of range [0, 1).")
	r = postRank(t, strict.url, sim.PathChat, sim.RankHeader, "0", chat(msg{"user", "hi"}))
	assert.Equal(t, http.StatusOK, r.Status)
}

// P→D→P across ranks: P's rank 1 prefills, D's rank 0 pulls from it, P's
// rank 0 reads D's blocks back, D's rank 1 pulls the new prompt.
func TestDPRoundTripAcrossRanks(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, func(c *sim.Config) { c.DPSize = 2; c.PrefixCaching = false })
	d := start(t, reg, nil, dp(2))

	turn1 := chat(msg{"user", words("first", 100)})
	rp := pinned(t, p.url, "1", with(turn1, "max_tokens", 1, "kv_transfer_params", missHandle()))
	require.NotNil(t, rp.KV)
	assert.Equal(t, p.RankEngineID(1), decodeHandle(t, rp.KV)["remote_engine_id"])
	rd := pinned(t, d.url, "0", with(turn1, "kv_transfer_params", rp.KV))
	assert.Equal(t, reference(t, sim.PathChat, turn1).Content, rd.Text)
	assert.Equal(t, sim.PullRead, lastRecord(d).Pull)
	assert.Equal(t, rp.Prompt, lastRecord(d).PulledTokens)
	assert.Zero(t, p.Stats().BlocksPinned, "rank 1 of P freed once D read")
	require.NotNil(t, rd.KV)
	dh := decodeHandle(t, rd.KV)
	_, dBase := d.SideChannel()
	assert.Equal(t, d.RankEngineID(0), dh["remote_engine_id"])
	assert.EqualValues(t, dBase, dh["remote_port"])

	turn2 := chat(msg{"user", words("first", 100)}, msg{"assistant", rd.Text}, msg{"user", words("second", 120)})
	rp2 := pinned(t, p.url, "0", with(turn2, "max_tokens", 1, "kv_transfer_params", asP(t, rd.KV)))
	rec := lastRecord(p)
	assert.Equal(t, 0, rec.Rank)
	assert.Equal(t, sim.PullRead, rec.Pull)
	assert.Equal(t, rd.Prompt+rd.Complete-1, rec.PulledTokens)
	assert.Zero(t, d.Stats().BlocksPinned, "rank 0 of D freed once P read")
	rd2 := pinned(t, d.url, "1", with(turn2, "kv_transfer_params", rp2.KV))
	assert.Equal(t, reference(t, sim.PathChat, turn2).Content, rd2.Text)
	assert.Equal(t, rp2.Prompt, lastRecord(d).PulledTokens, "rank 1 of D has none of rank 0's cache")
	for _, e := range []*node{p, d} {
		st := e.Stats()
		assert.Zero(t, st.WrongOutputs)
		assert.Zero(t, st.FreedReads)
		assert.Zero(t, st.LoadFailures)
	}
}

// A handle naming rank 0's engine id at rank 1's port fails as a wrong
// engine id does.
func TestDPWrongEngineIDAtRankPort(t *testing.T) {
	reg := sim.NewRegistry()
	p := start(t, reg, nil, dp(2))
	d := start(t, reg, nil, nil)
	body := chat(msg{"user", words("wrong", 100)})
	rp := pinned(t, p.url, "0", with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
	h := decodeHandle(t, rp.KV)
	require.Equal(t, p.RankEngineID(0), h["remote_engine_id"])
	h["remote_port"] = h["remote_port"].(float64) + 1
	r := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", h))
	assert.Equal(t, http.StatusInternalServerError, r.Status, string(r.Body))
	assert.Equal(t, sim.PullFailed, lastRecord(d).Pull)
	assert.Equal(t, 1, d.Stats().LoadFailures)
	assert.Equal(t, 1, p.Stats().HandlesEmitted)
	assert.NotZero(t, p.Stats().BlocksPinned, "rank 0 was never notified")

	host, port := p.RankSideChannel(1)
	peer := reg.Lookup(host, port)
	require.NotNil(t, peer)
	id, _, err := peer.Meta(context.Background())
	require.NoError(t, err)
	assert.Equal(t, p.RankEngineID(1), id)
	_, err = peer.Read(context.Background(), p.RankEngineID(0), "x", []int{1}, 1)
	assert.ErrorIs(t, err, sim.ErrEngineID)
	assert.ErrorIs(t, peer.Notify(context.Background(), p.RankEngineID(0), "x"), sim.ErrEngineID)
}

// X-data-parallel-rank pins the rank, whatever the case of its name; an
// out-of-range rank is vLLM's 400, a value int() cannot parse is ignored.
func TestDPRankHeader(t *testing.T) {
	e := start(t, nil, nil, dp(3))
	body := chat(msg{"user", "hello"})
	for _, hdr := range []string{"X-data-parallel-rank", "x-data-parallel-rank", "X-Data-Parallel-Rank"} {
		for range 2 {
			pinned := postRank(t, e.url, sim.PathChat, hdr, "2", body)
			require.Equal(t, http.StatusOK, pinned.Status, string(pinned.Body))
			assert.Equal(t, 2, lastRecord(e).Rank, hdr)
		}
	}
	for _, v := range []string{" 1 ", "+1", "0_1"} {
		require.Equal(t, http.StatusOK, postRank(t, e.url, sim.PathChat, sim.RankHeader, v, body).Status)
		assert.Equal(t, 1, lastRecord(e).Rank, "%q as Python's int() reads it", v)
	}
	for _, v := range []string{"3", "-1", "99999999999999999999999"} {
		r := postRank(t, e.url, sim.PathChat, sim.RankHeader, v, body)
		assert.Equal(t, http.StatusBadRequest, r.Status, v)
		var eb struct {
			Error struct {
				Message string `json:"message"`
				Type    string `json:"type"`
				Code    int    `json:"code"`
			} `json:"error"`
		}
		require.NoError(t, json.Unmarshal(r.Body, &eb), string(r.Body))
		assert.Equal(t, fmt.Sprintf("data_parallel_rank %s is out of range [0, 3).", v), eb.Error.Message)
		assert.Equal(t, "BadRequestError", eb.Error.Type)
		assert.Equal(t, 400, eb.Error.Code)
	}
	// Unparsable: the engine chooses, in turn.
	var ranks []int
	for range 3 {
		require.Equal(t, http.StatusOK, postRank(t, e.url, sim.PathChat, sim.RankHeader, "two", body).Status)
		ranks = append(ranks, lastRecord(e).Rank)
	}
	assert.ElementsMatch(t, []int{0, 1, 2}, ranks)

	// Streaming: vLLM checks the rank inside the stream generator, so the
	// error is an event of a 200 stream.
	r := postRank(t, e.url, sim.PathChat, sim.RankHeader, "7", with(body, "stream", true))
	require.Equal(t, http.StatusOK, r.Status)
	assert.Equal(t, "data: {\"error\": {\"message\": \"data_parallel_rank 7 is out of range [0, 3).\", "+
		"\"type\": \"BadRequestError\", \"param\": null, \"code\": 400}}\n\ndata: [DONE]\n\n", string(r.Body))
	rec := lastRecord(e)
	assert.Equal(t, http.StatusOK, rec.Status)
	assert.Contains(t, rec.Error, "out of range")

	r = postRank(t, e.url, sim.PathCompletions, sim.RankHeader, "3", map[string]any{"model": "sim-model", "prompt": "once"})
	assert.Equal(t, http.StatusBadRequest, r.Status)
}

// Each rank's side channel served over HTTP at its own port.
func TestDPHTTPSideChannels(t *testing.T) {
	// Listeners on consecutive ports are not guaranteed: the client maps
	// the handle's synthetic addresses to wherever the servers listen.
	addrs := map[string]string{}
	client := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
		if a, ok := addrs[addr]; ok {
			addr = a
		}
		return (&net.Dialer{}).DialContext(ctx, network, addr)
	}}}
	t.Cleanup(client.CloseIdleConnections)
	regP, regD := sim.NewRegistry(), sim.NewRegistry()
	regD.Dial = sim.HTTPDialer(client)
	p := start(t, regP, nil, func(c *sim.Config) { c.DPSize = 2; c.SideHost, c.SidePort = "10.9.0.1", 5600 })
	d := start(t, regD, nil, nil)
	for k := range 2 {
		srv := httptest.NewServer(sim.RankSideChannelHandler(p.Engine, k))
		t.Cleanup(srv.Close)
		host, port := p.RankSideChannel(k)
		addrs[net.JoinHostPort(host, fmt.Sprint(port))] = srv.Listener.Addr().String()
	}
	body := chat(msg{"user", words("http", 100)})
	for _, k := range []string{"1", "0"} {
		rp := pinned(t, p.url, k, with(body, "max_tokens", 1, "kv_transfer_params", missHandle()))
		rd := post(t, d.url, sim.PathChat, with(body, "kv_transfer_params", rp.KV))
		require.Equal(t, http.StatusOK, rd.Status, string(rd.Body))
		assert.Equal(t, sim.PullRead, lastRecord(d).Pull)
	}
	assert.Zero(t, p.Stats().BlocksPinned)
	assert.Zero(t, d.Stats().WrongOutputs)
}

func TestDPInvalidConfig(t *testing.T) {
	for _, mod := range []func(*sim.Config){
		func(c *sim.Config) { c.DPSize = -1 },
		func(c *sim.Config) { c.DPSize = 3; c.SideHost, c.SidePort = "h", 65534 },
	} {
		cfg := sim.DefaultConfig()
		mod(&cfg)
		_, err := sim.New(cfg)
		assert.ErrorIs(t, err, sim.ErrInvalidConfig)
	}
	reg := sim.NewRegistry()
	cfg := sim.DefaultConfig()
	cfg.Registry, cfg.SideHost, cfg.SidePort = reg, "h", 5601
	e, err := sim.New(cfg)
	require.NoError(t, err)
	defer e.Close()
	cfg.SidePort, cfg.DPSize = 5600, 2 // rank 1 would take 5601
	_, err = sim.New(cfg)
	assert.ErrorIs(t, err, sim.ErrAddrInUse)
	assert.Nil(t, reg.Lookup("h", 5600), "a failed start unregisters its ranks")
}
