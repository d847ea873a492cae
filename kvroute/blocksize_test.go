package kvroute_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// noCacheInfo fronts an engine whose /metrics carries no
// vllm:cache_config_info (vLLM run with --disable-log-stats serves no vllm:
// metrics at all).
func noCacheInfo(t *testing.T, e *kvroutetest.Engine) string {
	t.Helper()
	u, err := url.Parse(e.URL())
	require.NoError(t, err)
	proxy := httputil.NewSingleHostReverseProxy(u)
	return newServer(t, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" {
			proxy.ServeHTTP(w, r)
			return
		}
		rec := &bytes.Buffer{}
		proxy.ServeHTTP(&bufferWriter{h: http.Header{}, buf: rec}, r)
		sc := bufio.NewScanner(rec)
		sc.Buffer(make([]byte, 0, 1<<16), 1<<20)
		for sc.Scan() {
			if !strings.Contains(sc.Text(), "vllm:") {
				_, _ = io.WriteString(w, sc.Text()+"\n")
			}
		}
	}))
}

// cutHandles returns the remote_num_tokens and group lengths of the
// retained handles an engine's prefill legs carried to read.
func cutHandles(t *testing.T, e *kvroutetest.Engine) (tokens []int, groups [][]int) {
	t.Helper()
	for _, pr := range roleRecords(e, "prefill") {
		var body struct {
			KV struct {
				Blocks [][]int `json:"remote_block_ids"`
				N      int     `json:"remote_num_tokens"`
			} `json:"kv_transfer_params"`
		}
		require.NoError(t, json.Unmarshal(pr.Body, &body))
		if len(body.KV.Blocks) == 0 || body.KV.N == 0 {
			continue
		}
		var lens []int
		for _, g := range body.KV.Blocks {
			lens = append(lens, len(g))
		}
		tokens, groups = append(tokens, body.KV.N), append(groups, lens)
	}
	return tokens, groups
}

// Issue 29.1: with the default options, engines of any block size (16, 32,
// 64) serve every turn, reuse from the second, and a verified prefix is cut
// at the decode engine's own block size (read from its /metrics), never at
// a configured one: a WithVerification BlockSize that differs from the
// engines' yields to theirs.
func TestEngineBlockSizesLearned(t *testing.T) {
	for _, c := range []struct{ engine, configured int }{{16, 0}, {32, 0}, {64, 0}, {16, 32}, {64, 16}} {
		t.Run(fmt.Sprintf("engine %d configured %d", c.engine, c.configured), func(t *testing.T) {
			opts := []kvroutetest.Option{kvroutetest.WithReasoning(true), kvroutetest.WithBlockSize(c.engine)}
			cl := kvroutetest.NewCluster(t, 1, 1, opts...)
			rec := &kvroutetest.Records{}
			r := newRouter(t, cl, kvroute.WithObserver(rec), kvroute.WithVerification(kvroute.Verification{BlockSize: c.configured}))
			url := serve(t, r)
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 64, messages: []message{{Role: "system", Content: systemPrompt}}}
			recs := runTurns(t, url, rec, conv, 4, opts, nil)
			for i, tr := range recs[1:] {
				assert.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d: %s", i+1, tr.MissReason)
				assert.True(t, tr.Partial, "turn %d: the reasoning is not resent", i+1)
			}
			tokens, groups := cutHandles(t, cl.Prefill[0])
			require.NotEmpty(t, tokens)
			for i, n := range tokens {
				assert.Zero(t, n%c.engine, "cut at the engine's block size")
				assert.Equal(t, (n+c.engine-1)/c.engine, groups[i][0])
			}
			assert.Zero(t, r.Stats().InvalidHandles)
			assert.Zero(t, r.Stats().PartialRefused)
			for _, ph := range []kvroute.Phase{kvroute.PhasePrefill, kvroute.PhaseDecode} {
				st := r.Endpoints(ph)[0]
				assert.Equal(t, c.engine, st.BlockSize, ph)
				assert.Equal(t, "engine", st.BlockSizeSource, ph)
				assert.Equal(t, 1, st.KVGroups, ph)
				assert.Empty(t, st.NoReuse, ph)
			}
			for _, e := range append(cl.Prefill, cl.Decode...) {
				assert.Zero(t, e.Stats().WrongOutputs+e.Stats().AssertFailures)
			}
		})
	}
}

// Issue 29.1: engines that report no block size, with a configured one
// smaller than theirs, return handles that do not fit it. No turn fails:
// each is served without reuse (the decode engine prefills by itself, a
// plain request), counted, and the prefill engine shows why it serves
// without reuse; no handle reaches an engine that could misread it.
func TestBlockSizeMisfitServesWithoutReuse(t *testing.T) {
	opts := []kvroutetest.Option{kvroutetest.WithBlockSize(64)}
	cl := kvroutetest.NewCluster(t, 1, 1, opts...)
	rec := &kvroutetest.Records{}
	r, err := kvroute.New(kvroute.WithPrefill(noCacheInfo(t, cl.Prefill[0])), kvroute.WithDecode(noCacheInfo(t, cl.Decode[0])),
		kvroute.WithObserver(rec), kvroute.WithVerification(kvroute.Verification{BlockSize: 16}))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	recs := runTurns(t, url, rec, conv, 4, opts, nil)
	for i, tr := range recs {
		assert.NotEqual(t, kvroute.ReuseHit, tr.Reuse, "turn %d", i)
		assert.True(t, tr.LocalFallback, "turn %d: served by the decode engine alone", i)
	}
	assert.Equal(t, int64(1), r.Stats().UnvalidatedHandles, "one handle; later turns keep off the engine")
	st := r.Endpoints(kvroute.PhasePrefill)[0]
	assert.Equal(t, 16, st.BlockSize)
	assert.Equal(t, "configured", st.BlockSizeSource)
	assert.Contains(t, st.NoReuse, "fewer than remote_num_tokens")
	assert.Len(t, roleRecords(cl.Prefill[0], "prefill"), 1, "the prefill engine gets no turn while it serves without reuse")
	assert.Len(t, roleRecords(cl.Decode[0], "plain"), 4)
	for _, e := range append(cl.Prefill, cl.Decode...) {
		assert.Zero(t, e.Stats().WrongOutputs+e.Stats().AssertFailures)
	}
}

// Issue 29.1: a hybrid model (a full-attention group at 64-token blocks and
// a sliding-window group at 128 whose handle list holds only the window's
// tail) reuses whole handles from the second turn with the default options,
// with the single engine's answers; a handle that matches only in part is
// not cut (its groups differ in length: MissPartialRefused), never misread.
func TestHybridEngines(t *testing.T) {
	for _, reasoning := range []bool{false, true} {
		t.Run(fmt.Sprintf("reasoning=%v", reasoning), func(t *testing.T) {
			opts := []kvroutetest.Option{kvroutetest.WithBlockSize(64), kvroutetest.WithHybrid(128, 200), kvroutetest.WithReasoning(reasoning)}
			cl := kvroutetest.NewCluster(t, 1, 1, opts...)
			rec := &kvroutetest.Records{}
			r := newRouter(t, cl, kvroute.WithObserver(rec))
			url := serve(t, r)
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 64, messages: []message{{Role: "system", Content: systemPrompt}}}
			recs := runTurns(t, url, rec, conv, 4, opts, nil)
			for i, tr := range recs[1:] {
				if reasoning {
					assert.Equal(t, kvroute.MissPartialRefused, tr.MissReason, "turn %d", i+1)
					continue
				}
				assert.Equal(t, kvroute.ReuseHit, tr.Reuse, "turn %d: %s", i+1, tr.MissReason)
			}
			st := r.Endpoints(kvroute.PhaseDecode)[0]
			assert.Equal(t, 64, st.BlockSize)
			assert.Equal(t, 2, st.KVGroups)
			assert.Zero(t, r.Stats().InvalidHandles)
			for _, e := range append(cl.Prefill, cl.Decode...) {
				assert.Zero(t, e.Stats().WrongOutputs+e.Stats().AssertFailures)
			}
		})
	}
}
