package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// readyEngines reads /ready's engines.
func readyEngines(t *testing.T, p *inproc) (int, []engineState) {
	t.Helper()
	status, _, body := p.do(t, http.MethodGet, "/ready", "")
	var ready struct {
		Engines []engineState `json:"engines"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &ready), body)
	return status, ready.Engines
}

// conversePaths runs a conversation of turns turns on every API, without
// and with streaming, through p: every turn must be a 200 with a single
// engine's answer; it returns X-Bidikv-Reuse of each turn by API and mode.
func conversePaths(t *testing.T, p *inproc, turns int) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, path := range []string{"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"} {
		for _, stream := range []bool{false, true} {
			key := fmt.Sprintf("%s stream=%v", path, stream)
			c := newTenantConv(path, stream)
			for turn := range turns {
				c.ask(fmt.Sprintf("Turn %d of %s: name the next file to read.", turn, key))
				body := c.body()
				want, err := kvroutetest.Reference(path, body)
				require.NoError(t, err)
				status, reuse, text := c.send(t, p.client, p.url, nil)
				require.Equal(t, http.StatusOK, status, "%s turn %d: %s", key, turn, text)
				assert.Equal(t, want.Text, text, "%s turn %d: a single engine's answer", key, turn)
				out[key] = append(out[key], reuse)
			}
		}
	}
	return out
}

// partialOnly reports whether a conversation of this API and mode reuses
// only in part: Responses and Messages return no token ids, so only the
// prompt D's blocks begin with is verified, never the reply (a handle cut
// to it); Messages streams carry no handle at all.
func partialOnly(key string) bool {
	return strings.HasPrefix(key, "/v1/responses") || strings.HasPrefix(key, "/v1/messages")
}

// Issue 29.1: engines of block size 16, 32 or 64, and a hybrid model (a
// full-attention KV group at 64-token blocks beside a sliding-window group
// at 128 whose handle lists hold only the window's tail), behind the proxy
// with its default flags: every turn of every API is served with a single
// engine's answer, and reuses KV from the second turn (streams too, where
// the engines' streams carry the handle: all but Messages). On the hybrid
// model, Responses and Messages turns are not reused: they can reuse only
// a prefix of a handle (no token ids verify the reply), and a
// sliding-window group cannot be cut to one (vLLM frees its blocks out of
// the window): they miss as partial_refused, with the right answer. /ready
// shows each engine's block size, read from the engine, and its KV groups.
func TestEngineBlockSizesThroughProxy(t *testing.T) {
	for _, tc := range []struct {
		name   string
		opts   []kvroutetest.Option
		bs     int
		groups int
	}{
		{"16", []kvroutetest.Option{kvroutetest.WithBlockSize(16)}, 16, 1},
		{"32", []kvroutetest.Option{kvroutetest.WithBlockSize(32)}, 32, 1},
		{"64", []kvroutetest.Option{kvroutetest.WithBlockSize(64)}, 64, 1},
		{"hybrid 64 and sliding window 128", []kvroutetest.Option{kvroutetest.WithBlockSize(64), kvroutetest.WithHybrid(128, 200)}, 64, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 1, 1, append(tc.opts, kvroutetest.WithStreamHandles(true))...)
			p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL())
			for key, reuse := range conversePaths(t, p, 3) {
				switch {
				case key == "/v1/messages stream=true":
					// vLLM's Messages streams carry no handle.
				case tc.groups > 1 && partialOnly(key):
					assert.Equal(t, []string{"miss", "miss", "miss"}, reuse, key)
				default:
					assert.Equal(t, []string{"miss", "hit", "hit"}, reuse, key)
				}
			}
			if tc.groups > 1 {
				assert.NotEqual(t, "0", p.metric(t, `bidikv_reuse_misses_total{reason="partial_refused"}`))
			}
			_, engines := readyEngines(t, p)
			require.Len(t, engines, 2)
			for _, e := range engines {
				assert.Equal(t, tc.bs, e.BlockSize, e.Endpoint)
				assert.Equal(t, "engine", e.BlockSizeSource, e.Endpoint)
				assert.Equal(t, tc.groups, e.KVGroups, e.Endpoint)
				assert.Empty(t, e.NoReuse, e.Endpoint)
			}
			assert.Equal(t, "0", p.metric(t, "bidikv_invalid_handles_total"))
			for _, e := range append(cl.Prefill, cl.Decode...) {
				st := e.Stats()
				assert.Zero(t, st.WrongOutputs+st.AssertFailures+st.FreedReads, "%+v", st)
			}
		})
	}
}

// noVLLMMetrics fronts an engine whose /metrics carries no vllm: series, as
// vLLM run with --disable-log-stats serves it: no vllm:cache_config_info,
// so no block size.
func noVLLMMetrics(t *testing.T, e *kvroutetest.Engine) string {
	return metricsFront(t, e, func(w http.ResponseWriter) {
		resp, err := http.Get(e.URL() + "/metrics")
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadGateway)
			return
		}
		defer resp.Body.Close()
		sc := bufio.NewScanner(resp.Body)
		sc.Buffer(make([]byte, 0, 1<<16), 1<<20)
		for sc.Scan() {
			if !strings.Contains(sc.Text(), "vllm:") {
				_, _ = io.WriteString(w, sc.Text()+"\n")
			}
		}
	})
}

// Issue 29.1: engines of block size 64 that report none. With the default
// flags their handles are reused whole (their block counts unchecked:
// nothing says how many they need), never in part (Responses and Messages
// reuse only in part). With --block-size 16, a size their
// handles do not fit, no turn fails: each is served without reuse (the
// decode engine prefills by itself), counted, and /ready names the prefill
// engine serving without reuse and why; no engine ever reads a handle it
// could misread.
func TestBlockSizeUnknownOrWrongThroughProxy(t *testing.T) {
	for _, tc := range []struct {
		name  string
		args  []string
		reuse []string
	}{
		{"unknown: whole handles", nil, []string{"miss", "hit", "hit"}},
		{"--block-size 16 for engines of 64: served without reuse", []string{"--block-size", "16"}, []string{"miss", "miss", "miss"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithBlockSize(64), kvroutetest.WithStreamHandles(true))
			pu, du := noVLLMMetrics(t, cl.Prefill[0]), noVLLMMetrics(t, cl.Decode[0])
			p := startInProcess(t, nil, append([]string{"--prefill", pu, "--decode", du}, tc.args...)...)
			for key, reuse := range conversePaths(t, p, 3) {
				switch {
				case partialOnly(key):
					assert.Equal(t, []string{"miss", "miss", "miss"}, reuse, key)
				default:
					assert.Equal(t, tc.reuse, reuse, key)
				}
			}
			status, engines := readyEngines(t, p)
			assert.Equal(t, http.StatusOK, status)
			require.Len(t, engines, 2)
			if tc.args == nil {
				assert.Zero(t, engines[0].BlockSize)
				assert.Equal(t, "0", p.metric(t, "bidikv_unvalidated_handles_total"))
			} else {
				assert.Equal(t, 16, engines[0].BlockSize)
				assert.Equal(t, "configured", engines[0].BlockSizeSource)
				assert.Contains(t, engines[0].NoReuse, "needs at block size 16")
				assert.NotEqual(t, "0", p.metric(t, "bidikv_unvalidated_handles_total"))
				assert.NotEqual(t, "0", p.metric(t, "bidikv_local_prefill_fallbacks_total"))
				assert.Contains(t, p.stderr.String(), `msg="kvroute: an engine's KV handle holds fewer blocks than its block size needs; the turn is served without reuse`)
			}
			for _, e := range append(cl.Prefill, cl.Decode...) {
				st := e.Stats()
				assert.Zero(t, st.WrongOutputs+st.AssertFailures+st.FreedReads, "%+v", st)
			}
		})
	}
}

// Issue 29.2: engine addresses without a scheme (--decode 127.0.0.1:8200)
// are http:// addresses everywhere: the turns reuse, /ready is 200 and
// names the engines by their URL, and the doctor reaches them.
func TestSchemelessEngineAddresses(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	pu, du := strings.TrimPrefix(cl.Prefill[0].URL(), "http://"), strings.TrimPrefix(cl.Decode[0].URL(), "http://")
	p := startInProcess(t, nil, "--prefill", pu, "--decode", du+"/")
	c := newTenantConv("/v1/chat/completions", false)
	for turn := range 2 {
		c.ask(fmt.Sprintf("Turn %d: list the failing tests.", turn))
		status, reuse, text := c.send(t, p.client, p.url, nil)
		require.Equal(t, http.StatusOK, status, text)
		assert.Equal(t, []string{"miss", "hit"}[turn], reuse)
	}
	status, engines := readyEngines(t, p)
	assert.Equal(t, http.StatusOK, status)
	require.Len(t, engines, 2)
	assert.Equal(t, cl.Prefill[0].URL(), engines[0].Endpoint)
	assert.Equal(t, cl.Decode[0].URL(), engines[1].Endpoint)
	for _, e := range engines {
		assert.True(t, e.Up, e.Endpoint)
		assert.NotNil(t, e.Capabilities, e.Endpoint)
	}

	var stdout, stderr bytes.Buffer
	err := run(t.Context(), []string{"doctor", "--prefill", pu, "--decode", du, "--json"}, noEnv, &stdout, &stderr)
	require.NoError(t, err, stdout.String())
	assert.Contains(t, stdout.String(), `"endpoint": "`+cl.Decode[0].URL()+`"`)
	assert.Contains(t, stdout.String(), `"reuse_works": true`)
}

// Issue 29.2: an engine down for any reason (connection refused, /health
// answering 503, no answer within --health-timeout) is named in /ready
// with its reason, and logged once with it.
func TestReadyNamesWhyEnginesAreDown(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	refused := httptest.NewServer(http.NotFoundHandler())
	refusedURL := refused.URL
	refused.Close()
	sick := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		http.Error(w, "engine dead", http.StatusServiceUnavailable)
	}))
	t.Cleanup(sick.Close)
	stall := make(chan struct{})
	slow := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-stall:
		case <-r.Context().Done():
		}
	}))
	t.Cleanup(func() { close(stall); slow.Close() })
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--prefill", refusedURL,
		"--decode", cl.Decode[0].URL(), "--decode", sick.URL, "--decode", slow.URL, "--health-timeout", "200ms")
	var engines []engineState
	for range 3 {
		_, engines = readyEngines(t, p)
	}
	why := map[string]string{}
	for _, e := range engines {
		if e.Up {
			assert.Empty(t, e.Reason, e.Endpoint)
			continue
		}
		why[e.Endpoint] = e.Reason
	}
	assert.Contains(t, why[refusedURL], "connection refused")
	assert.Equal(t, "GET /health answered 503 Service Unavailable", why[sick.URL])
	assert.Equal(t, "GET /health: no answer within --health-timeout 200ms", why[slow.URL])
	log := p.stderr.String()
	for url, reason := range why {
		line := fmt.Sprintf(`msg="engine health changed" role=%%s endpoint=%s up=false reason=%q`, url, reason)
		n := strings.Count(log, fmt.Sprintf(line, "prefill")) + strings.Count(log, fmt.Sprintf(line, "decode"))
		assert.Equal(t, 1, n, "logged once with its reason: %s\n%s", url, log)
	}
}

// Issue 29.1 with real processes: vllmsim engines started with
// --block-size 64 (and a hybrid model's KV groups), the proxy with the
// reference proxy's flags and nothing about block sizes: every streamed
// turn (as vLLM's multi-turn benchmark sends it) is a 200 with a single
// engine's answer, reused from the second.
func TestBlockSize64Processes(t *testing.T) {
	t.Parallel() // real processes
	for _, tc := range []struct {
		name string
		args []string
	}{
		{"64", []string{"--block-size", "64"}},
		{"hybrid", []string{"--block-size", "64", "--kv-groups", "2", "--kv-group-block-size", "128", "--sliding-window", "200"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, d := startEngine(t, tc.args...), startEngine(t, tc.args...)
			px := startProxy(t, p, d)
			msgs := []map[string]string{{"role": "system", "content": reuseSystem}}
			for i := range 3 {
				msgs = append(msgs, map[string]string{"role": "user", "content": fmt.Sprintf("Turn %d: which test fails first?", i)})
				body := chatBody(msgs, 16, "c64")
				resp := post(t, px.url, body, "c64")
				got := readStream(t, resp, bufio.NewReader(resp.Body))
				require.Equal(t, http.StatusOK, got.status, got.raw)
				assert.Equal(t, reference(t, body), got.text, "turn %d", i)
				assert.Equal(t, []string{"miss", "hit", "hit"}[i], got.reuse, "turn %d", i)
				msgs = append(msgs, map[string]string{"role": "assistant", "content": got.text})
			}
			_, page := get(t, px.url+"/metrics")
			assert.Equal(t, "0", metricValue(page, "bidikv_invalid_handles_total"))
		})
	}
}
