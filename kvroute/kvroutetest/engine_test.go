package kvroutetest_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

const chatPath = "/v1/chat/completions"

type answer struct {
	status int
	text   string
	kv     json.RawMessage
}

func postJSON(t *testing.T, url string, body []byte) answer {
	t.Helper()
	resp, err := http.Post(url+chatPath, "application/json", bytes.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	var b struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	a := answer{status: resp.StatusCode}
	if resp.StatusCode == http.StatusOK {
		require.NoError(t, json.NewDecoder(resp.Body).Decode(&b))
		a.text = b.Choices[0].Message.Content
		if string(b.KV) != "null" {
			a.kv = b.KV
		}
	}
	return a
}

func body(t *testing.T, kv any, maxTokens int) []byte {
	t.Helper()
	m := map[string]any{"model": "sim-model", "messages": []any{map[string]any{"role": "user", "content": "tell me about the sea, in a few words please"}}}
	if kv != nil {
		m["kv_transfer_params"] = kv
	}
	if maxTokens > 0 {
		m["max_tokens"] = maxTokens
	}
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return b
}

var miss = map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
	"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}

func TestClusterTurn(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 2)
	require.Len(t, c.Prefill, 1)
	require.Len(t, c.Decode, 2)
	assert.Nil(t, c.Clock)
	P, D := c.Prefill[0], c.Decode[1]
	p := postJSON(t, P.URL(), body(t, miss, 1))
	require.Equal(t, http.StatusOK, p.status)
	require.NotNil(t, p.kv)
	d := postJSON(t, D.URL(), body(t, json.RawMessage(p.kv), 0))
	require.Equal(t, http.StatusOK, d.status)

	want, err := kvroutetest.Reference(chatPath, body(t, nil, 0))
	require.NoError(t, err)
	assert.Equal(t, want.Text, d.text)
	assert.Equal(t, "stop", want.FinishReason)
	n, err := kvroutetest.CountTokens(chatPath, body(t, nil, 0))
	require.NoError(t, err)
	assert.Equal(t, n, want.PromptTokens)

	ps, ds := P.Stats(), D.Stats()
	assert.Equal(t, 1, ps.PrefillRequests)
	assert.Equal(t, 1, ds.DecodeRequests)
	assert.Equal(t, n, ds.TokensPulledIn)
	assert.Equal(t, n, ps.TokensPulledOut)
	assert.Zero(t, ps.BlocksPinned)
	assert.Positive(t, ds.BlocksPinned)
	assert.Zero(t, ds.WrongOutputs)
	assert.Zero(t, c.Decode[0].Stats().Requests)

	recs := D.Requests()
	require.Len(t, recs, 1)
	assert.Equal(t, "decode", recs[0].Role)
	assert.Equal(t, n, recs[0].PulledTokens)
	assert.JSONEq(t, string(d.kv), string(recs[0].Handle))

	var h map[string]any
	require.NoError(t, json.Unmarshal(d.kv, &h))
	host, port := D.SideChannel()
	assert.Equal(t, host, h["remote_host"])
	assert.EqualValues(t, port, h["remote_port"])
	assert.Equal(t, D.EngineID(), h["remote_engine_id"])
	assert.InDelta(t, D.Monotonic()+480, h["remote_blocks_expiry_time"], 1)
}

func TestRefuse(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	require.Equal(t, http.StatusOK, postJSON(t, e.URL(), body(t, nil, 0)).status)
	e.Refuse(true)
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	_, err := client.Post(e.URL()+chatPath, "application/json", bytes.NewReader(body(t, nil, 0)))
	require.Error(t, err)
	e.Refuse(false)
	resp, err := client.Post(e.URL()+chatPath, "application/json", bytes.NewReader(body(t, nil, 0)))
	require.NoError(t, err)
	resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Equal(t, 2, e.Stats().Requests, "refused connections never reach the engine")
}

func TestFaultsThroughPublicAPI(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	e.FailNext(1, http.StatusServiceUnavailable)
	assert.Equal(t, http.StatusServiceUnavailable, postJSON(t, e.URL(), body(t, nil, 0)).status)
	assert.Equal(t, http.StatusOK, postJSON(t, e.URL(), body(t, nil, 0)).status)
	id := e.EngineID()
	e.Restart()
	assert.NotEqual(t, id, e.EngineID())
	assert.Equal(t, 1, e.Stats().Restarts)
	recs := e.Requests()
	require.Len(t, recs, 2)
	assert.Equal(t, http.StatusServiceUnavailable, recs[0].Status)
	assert.Equal(t, "plain", recs[1].Role)
}

func TestStartEngineRejectsInvalidOptions(t *testing.T) {
	tests := map[string]kvroutetest.Option{
		"block size": kvroutetest.WithBlockSize(0),
		"blocks":     kvroutetest.WithNumBlocks(-1),
		"model len":  kvroutetest.WithMaxModelLen(kvroutetest.DefaultNumBlocks*16 + 1),
		"policy":     kvroutetest.WithKVLoadFailurePolicy("retry"),
		"threshold":  kvroutetest.WithRecomputeThreshold(-1),
		"ttl":        kvroutetest.WithDecoderBlocksTTL(0),
		"lease":      kvroutetest.WithLeaseDuration(-time.Second),
		"speed":      kvroutetest.WithSpeed(-1),
		"tp":         kvroutetest.WithTPSize(0),
		"model":      kvroutetest.WithModel(""),
	}
	for name, opt := range tests {
		t.Run(name, func(t *testing.T) {
			e, err := kvroutetest.StartEngine(opt)
			require.Error(t, err)
			assert.Nil(t, e)
			assert.True(t, errors.Is(err, kvroutetest.ErrInvalidConfig))
		})
	}
}

func TestSideChannelOption(t *testing.T) {
	reg := kvroutetest.NewRegistry()
	e := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithSideChannel("fd00::7", 5601))
	host, port := e.SideChannel()
	assert.Equal(t, "fd00::7", host)
	assert.Equal(t, 5601, port)
	_, err := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg), kvroutetest.WithSideChannel("fd00::7", 5601))
	assert.Error(t, err, "address taken in the registry")
}

func TestVirtualClock(t *testing.T) {
	start := time.Unix(1000, 0)
	c := kvroutetest.NewVirtualClock(start)
	assert.Equal(t, start, c.Now())
	c.Advance(time.Minute)
	c.Advance(-time.Hour)
	assert.Equal(t, start.Add(time.Minute), c.Now())
}

func TestReferenceErrors(t *testing.T) {
	_, err := kvroutetest.Reference(chatPath, []byte(`{`))
	assert.ErrorIs(t, err, kvroutetest.ErrBadRequest)
	_, err = kvroutetest.CountTokens("/v1/embeddings", []byte(`{}`))
	assert.ErrorIs(t, err, kvroutetest.ErrBadRequest)
}
