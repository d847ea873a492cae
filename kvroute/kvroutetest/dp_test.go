package kvroutetest_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// postRank posts to the chat endpoint pinned to a data-parallel rank.
func postRank(t *testing.T, url string, rank int, b []byte) answer {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+chatPath, bytes.NewReader(b))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Data-Parallel-Rank", strconv.Itoa(rank))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, _ := io.ReadAll(resp.Body)
	a := answer{status: resp.StatusCode}
	if resp.StatusCode == http.StatusOK {
		var parsed struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
			KV json.RawMessage `json:"kv_transfer_params"`
		}
		require.NoError(t, json.Unmarshal(raw, &parsed), string(raw))
		a.text = parsed.Choices[0].Message.Content
		if string(parsed.KV) != "null" {
			a.kv = parsed.KV
		}
	}
	return a
}

func handleOf(t *testing.T, kv json.RawMessage) map[string]any {
	t.Helper()
	var h map[string]any
	require.NoError(t, json.Unmarshal(kv, &h))
	return h
}

// A 1P1D turn across ranks: P's rank 1 prefills, D's rank 0 decodes, and
// D's handle goes back to P's rank 0.
func TestDPClusterTurn(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithDPSize(2), kvroutetest.WithRecomputeThreshold(0))
	P, D := c.Prefill[0], c.Decode[0]
	require.Equal(t, 2, P.DPSize())
	p := postRank(t, P.URL(), 1, body(t, miss, 1))
	require.Equal(t, http.StatusOK, p.status)
	ph := handleOf(t, p.kv)
	assert.Equal(t, P.RankEngineID(1), ph["remote_engine_id"])
	assert.True(t, strings.HasSuffix(P.RankEngineID(1), "_dp1"))
	host, base := P.SideChannel()
	h1, p1 := P.RankSideChannel(1)
	assert.Equal(t, host, h1)
	assert.Equal(t, base+1, p1)
	assert.EqualValues(t, p1, ph["remote_port"])

	d := postRank(t, D.URL(), 0, body(t, json.RawMessage(p.kv), 0))
	require.Equal(t, http.StatusOK, d.status)
	want, err := kvroutetest.Reference(chatPath, body(t, nil, 0))
	require.NoError(t, err)
	assert.Equal(t, want.Text, d.text)
	dh := handleOf(t, d.kv)
	assert.Equal(t, D.RankEngineID(0), dh["remote_engine_id"])
	recs := D.Requests()
	require.Len(t, recs, 1)
	assert.Equal(t, 0, recs[0].Rank)
	assert.Equal(t, want.PromptTokens, recs[0].PulledTokens)
	assert.Equal(t, 1, P.Requests()[0].Rank)

	dh["do_remote_decode"], dh["do_remote_prefill"] = true, false
	p2 := postRank(t, P.URL(), 0, body(t, dh, 1))
	require.Equal(t, http.StatusOK, p2.status)
	assert.Equal(t, "pull", P.Requests()[1].Pull, "P's rank 0 reads D's rank 0")
	assert.Zero(t, D.Stats().BlocksPinned)
	assert.Zero(t, D.Stats().WrongOutputs)

	assert.Equal(t, http.StatusBadRequest, postRank(t, P.URL(), 2, body(t, nil, 0)).status)
	_, err = kvroutetest.StartEngine(kvroutetest.WithDPSize(0))
	assert.ErrorIs(t, err, kvroutetest.ErrInvalidConfig)
}

func TestStrictRankOption(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	assert.Equal(t, http.StatusOK, postRank(t, e.URL(), 1, body(t, nil, 0)).status, "one rank ignores the header")
	strict := kvroutetest.NewEngine(t, kvroutetest.WithStrictRank(true))
	assert.Equal(t, http.StatusBadRequest, postRank(t, strict.URL(), 1, body(t, nil, 0)).status)
	assert.Equal(t, http.StatusOK, postRank(t, strict.URL(), 0, body(t, nil, 0)).status)
}

func TestFingerprintOption(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	_, ok := e.Fingerprint()
	assert.False(t, ok, "absent by default")
	e = kvroutetest.NewEngine(t, kvroutetest.WithFingerprint("full", ""), kvroutetest.WithDPSize(2))
	fp, ok := e.Fingerprint()
	require.True(t, ok)
	assert.Regexp(t, `^vllm-.+-dp2-[0-9a-f]{8}$`, fp)
	resp, err := http.Post(e.URL()+chatPath, "application/json", bytes.NewReader(body(t, nil, 0)))
	require.NoError(t, err)
	defer resp.Body.Close()
	var b struct {
		SystemFingerprint *string `json:"system_fingerprint"`
	}
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&b))
	require.NotNil(t, b.SystemFingerprint)
	assert.Equal(t, fp, *b.SystemFingerprint)
	_, err = kvroutetest.StartEngine(kvroutetest.WithFingerprint("sometimes", ""))
	assert.ErrorIs(t, err, kvroutetest.ErrInvalidConfig)
}
