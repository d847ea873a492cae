package main

import (
	"bytes"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"strconv"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/sim"
)

func TestParseFlagsDataParallelAndFingerprint(t *testing.T) {
	o, err := parseFlags([]string{"--data-parallel-size", "4", "--strict-rank", "--fingerprint-mode", "custom",
		"--fingerprint-value", "fp-1"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 4, o.cfg.DPSize)
	assert.True(t, o.cfg.StrictRank)
	assert.Equal(t, sim.FingerprintCustom, o.cfg.Fingerprint)
	assert.Equal(t, "fp-1", o.cfg.FingerprintValue)

	d, err := parseFlags(nil, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 1, d.cfg.DPSize)
	assert.False(t, d.cfg.StrictRank)
	assert.Equal(t, sim.FingerprintAbsent, d.cfg.Fingerprint)

	_, err = parseFlags([]string{"--data-parallel-size", "0"}, io.Discard)
	assert.Error(t, err)
	o, err = parseFlags([]string{"--fingerprint-mode", "sometimes"}, io.Discard)
	require.NoError(t, err, "validated when the engine starts")
	_, err = sim.New(o.cfg)
	assert.ErrorIs(t, err, sim.ErrInvalidConfig)
}

func TestListenRun(t *testing.T) {
	lns, err := listenRun("127.0.0.1", 0, 3)
	require.NoError(t, err)
	require.Len(t, lns, 3)
	base := lns[0].Addr().(*net.TCPAddr).Port
	for k, ln := range lns {
		assert.Equal(t, base+k, ln.Addr().(*net.TCPAddr).Port)
	}
	_, err = listenRun("127.0.0.1", base+1, 1)
	assert.Error(t, err, "a taken port fails")
	for _, ln := range lns {
		require.NoError(t, ln.Close())
	}
}

// postPinned is call with X-data-parallel-rank.
func postPinned(t *testing.T, url string, rank int, body map[string]any) (string, json.RawMessage) {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, _ := http.NewRequest(http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(raw))
	req.Header.Set("X-data-parallel-rank", strconv.Itoa(rank))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var out struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	require.NoError(t, json.Unmarshal(b, &out))
	return out.Choices[0].Message.Content, out.KV
}

// A two-rank P process and a D process: D reads rank 1's blocks through
// rank 1's side-channel port, and P's rank 0 reads D's back.
func TestDataParallelProcess(t *testing.T) {
	kvc := `{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_recompute_threshold":0}}`
	p := spawn(t, "--kv-transfer-config", kvc, "--no-enable-prefix-caching", "--data-parallel-size", "2",
		"--fingerprint-mode", "full")
	d := spawn(t, "--kv-transfer-config", kvc)

	miss := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
	long := "the quick brown fox jumps over the lazy dog and keeps running through the forest until nightfall"
	turn1 := messages(long + " " + long)
	_, ph := postPinned(t, p.url, 1, withKV(turn1, miss, 1))
	var h map[string]any
	require.NoError(t, json.Unmarshal(ph, &h))
	assert.Equal(t, p.engine[:len(p.engine)-len("_dp0")]+"_dp1", h["remote_engine_id"])
	_, sidePort, err := net.SplitHostPort(p.side)
	require.NoError(t, err)
	base, _ := strconv.Atoi(sidePort)
	assert.EqualValues(t, base+1, h["remote_port"])

	reply, dh := call(t, d.url, withKV(turn1, json.RawMessage(ph), 0))
	assert.Equal(t, reference(t, turn1), reply)
	assert.Zero(t, stats(t, p.url).BlocksPinned, "D's notify reached rank 1")

	var dm map[string]any
	require.NoError(t, json.Unmarshal(dh, &dm))
	dm["do_remote_decode"], dm["do_remote_prefill"] = true, false
	turn2 := messages(long+" "+long, reply, "and then what happened to the fox")
	_, _ = postPinned(t, p.url, 0, withKV(turn2, dm, 1))
	assert.Positive(t, stats(t, p.url).TokensPulledIn, "rank 0 read D across processes")
	assert.Zero(t, stats(t, d.url).BlocksPinned)
	assert.Zero(t, stats(t, d.url).WrongOutputs)
}
