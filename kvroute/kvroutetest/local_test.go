package kvroutetest_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func chatBody(t *testing.T, msgs ...string) []byte {
	t.Helper()
	var ms []map[string]string
	for i, m := range msgs {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		ms = append(ms, map[string]string{"role": role, "content": m})
	}
	b, err := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "messages": ms, "max_tokens": 8})
	require.NoError(t, err)
	return b
}

// TestPlainPrefillOnDecodeEngine: a plain request (a decode-local turn)
// computes what the engine's prefix cache lacks, priced by LocalPrefill,
// which costs more per token than the prefill engine's Prefill; under
// memory pressure the cache is evicted and the request computes the whole
// prompt, with the same answer.
func TestPlainPrefillOnDecodeEngine(t *testing.T) {
	prof, ok := kvroutetest.LookupProfile("qwen3-32b")
	require.True(t, ok)
	require.Positive(t, prof.LocalPrefillFactor)
	e := kvroutetest.NewEngine(t, kvroutetest.WithProfile(prof), kvroutetest.WithNumBlocks(64))
	history := strings.Repeat("the tool printed a long log line ", 60)
	first := postJSON(t, e.URL(), chatBody(t, history))
	require.Equal(t, http.StatusOK, first.status)
	follow := chatBody(t, history, first.text, "now the next short tool result")
	second := postJSON(t, e.URL(), follow)
	require.Equal(t, http.StatusOK, second.status)

	// Unrelated prompts fill the 64 blocks and evict the cached history.
	for i := range 2 {
		other := postJSON(t, e.URL(), chatBody(t, fmt.Sprintf("%d %s", i, strings.Repeat("an unrelated conversation fills the cache ", 70))))
		require.Equal(t, http.StatusOK, other.status)
	}
	third := postJSON(t, e.URL(), follow)
	require.Equal(t, http.StatusOK, third.status)
	assert.Equal(t, second.text, third.text, "an evicted cache changes the cost, not the answer")

	recs := e.Requests()
	require.Len(t, recs, 5)
	for _, r := range recs {
		require.Equal(t, "plain", r.Role)
		assert.False(t, r.Wrong)
		assert.Equal(t, prof.LocalPrefill(r.ComputedTokens, r.PromptTokens-r.ComputedTokens), r.Prefill)
	}
	hit, evicted := recs[1], recs[4]
	assert.Positive(t, hit.CachedTokens, "the history's blocks are still cached")
	assert.Less(t, hit.ComputedTokens, hit.PromptTokens/2)
	// vLLM evicts a freed sequence's tail blocks first: a prefix survives.
	assert.Less(t, evicted.CachedTokens, hit.CachedTokens/2, "evicted under memory pressure")
	assert.Greater(t, evicted.ComputedTokens, hit.PromptTokens/2)
	assert.Greater(t, evicted.Prefill, hit.Prefill)
	// Worse per token than P's prefill of the same work.
	assert.Greater(t, prof.LocalPrefill(2000, 20000)-prof.LocalPrefillOverhead, prof.Prefill(2000, 20000)-prof.PrefillOverhead)
}
