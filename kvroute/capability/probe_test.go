package capability_test

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
)

// probe probes url with a transport of its own.
func probe(t *testing.T, url string, opts ...capability.Option) *capability.Report {
	t.Helper()
	ep, err := transport.ParseEndpoint(url)
	require.NoError(t, err)
	tr := &http.Transport{}
	t.Cleanup(tr.CloseIdleConnections)
	return capability.Probe(context.Background(), tr, ep, opts...)
}

// states maps every capability of r to its state.
func states(r *capability.Report) map[string]capability.State {
	out := map[string]capability.State{}
	for _, n := range r.Facts() {
		out[n.Name] = n.Fact.State
	}
	return out
}

const (
	P = capability.Present
	A = capability.Absent
	U = capability.Unknown
)

// TestProbeSimulatedEngines probes the simulated engine in each
// configuration a stock vLLM can be found in and checks every fact that
// changes, with its reason and fix.
func TestProbeSimulatedEngines(t *testing.T) {
	all := func(s capability.State, f func(capability.API) string) map[string]capability.State {
		m := map[string]capability.State{}
		for _, a := range capability.APIs {
			m[f(a)] = s
		}
		return m
	}
	merge := func(ms ...map[string]capability.State) map[string]capability.State {
		out := map[string]capability.State{}
		for _, m := range ms {
			for k, v := range m {
				out[k] = v
			}
		}
		return out
	}
	// A current engine with everything: what is not observable stays unknown.
	full := merge(all(P, capability.RenderName), all(P, capability.HandlesName), map[string]capability.State{
		"version": P, "tokenize": P, "return_token_ids": P, "prefix_caching": P, "metrics": P, "bidirectional": U,
		"stream_handles_chat": U, "stream_handles_completions": U, "stream_handles_responses": P, "stream_handles_messages": A,
	})
	cases := []struct {
		name string
		opts []kvroutetest.Option
		want map[string]capability.State
		why  map[string]string // capability: a substring of its Why
		fix  map[string]string // capability: a substring of its Fix
		// check inspects the rest.
		check func(t *testing.T, r *capability.Report)
	}{
		{name: "current", want: full, check: func(t *testing.T, r *capability.Report) {
			assert.Equal(t, kvroutetest.DefaultVersion, r.VLLMVersion)
			assert.Equal(t, "sim-model", r.Model)
			assert.Equal(t, 16, r.BlockSize)
			assert.Equal(t, 8193, r.NumGPUBlocks)
			assert.Equal(t, int64(8192*16), r.KVCacheTokens)
			assert.Equal(t, 1, r.DataParallel)
			assert.WithinDuration(t, time.Now(), r.ProcessStart, time.Minute)
			path, f := r.TokenPath(capability.Chat)
			assert.Equal(t, capability.TokensRender, path)
			assert.Equal(t, P, f.State)
		}},
		{name: "render 404 (no --enable-scale-out)", opts: []kvroutetest.Option{kvroutetest.WithRenderRoutes(false)},
			want: merge(full, all(A, capability.RenderName)),
			why:  map[string]string{"render_chat": "POST /v1/chat/completions/render: 404: route not registered (vllm serve without --enable-scale-out)"},
			fix:  map[string]string{"render_messages": "--enable-scale-out"},
			check: func(t *testing.T, r *capability.Report) {
				path, f := r.TokenPath(capability.Chat)
				assert.Equal(t, capability.TokensTokenize, path)
				assert.Equal(t, P, f.State)
				assert.Contains(t, f.Fix, "--enable-scale-out")
				path, f = r.TokenPath(capability.Responses)
				assert.Equal(t, capability.TokensNone, path)
				assert.Equal(t, A, f.State)
				assert.Contains(t, f.Fix, "--enable-scale-out")
			}},
		{name: "render 501 (no renderer)", opts: []kvroutetest.Option{kvroutetest.WithRenderer(false)},
			want: merge(full, all(A, capability.RenderName)),
			why:  map[string]string{"render_responses": `501: no renderer for this API "The model does not support Responses Render API"`},
			fix:  map[string]string{"render_chat": "renderer"}},
		{name: "render 404 and no /tokenize", opts: []kvroutetest.Option{kvroutetest.WithRenderRoutes(false), kvroutetest.WithTokenize(false)},
			want: merge(full, all(A, capability.RenderName), map[string]capability.State{"tokenize": A}),
			check: func(t *testing.T, r *capability.Report) {
				path, f := r.TokenPath(capability.Completions)
				assert.Equal(t, capability.TokensNone, path)
				assert.Equal(t, A, f.State)
			}},
		{name: "no prefix caching", opts: []kvroutetest.Option{kvroutetest.WithPrefixCaching(false)},
			want: merge(full, map[string]capability.State{"prefix_caching": A}),
			why:  map[string]string{"prefix_caching": "enable_prefix_caching=False"},
			fix:  map[string]string{"prefix_caching": "--no-enable-prefix-caching"}},
		{name: "block size 32, 4 data-parallel ranks", opts: []kvroutetest.Option{kvroutetest.WithBlockSize(32), kvroutetest.WithNumBlocks(1000), kvroutetest.WithDPSize(4)},
			want: full, check: func(t *testing.T, r *capability.Report) {
				assert.Equal(t, 32, r.BlockSize)
				assert.Equal(t, 1001, r.NumGPUBlocks)
				assert.Equal(t, int64(32000), r.KVCacheTokens)
				assert.Equal(t, 4, r.DataParallel)
			}},
		{name: "before PRs #37424 and #37535 (v0.18.1)", opts: []kvroutetest.Option{kvroutetest.WithVersion("0.18.1")},
			want: merge(full, map[string]capability.State{"handles_responses": A, "handles_messages": A,
				"stream_handles_responses": A, "bidirectional": A}),
			why: map[string]string{"handles_responses": "vLLM 0.18.1 predates kv_transfer_params on /v1/responses (PR #37424, v0.19.0)",
				"bidirectional": "predates bidirectional_kv_xfer (PR #32553, v0.21.0)"},
			fix: map[string]string{"handles_messages": "upgrade vLLM to 0.19.0 or later", "bidirectional": "0.21.0"}},
		{name: "pre-release of 0.21 (dev build)", opts: []kvroutetest.Option{kvroutetest.WithVersion("0.21.0rc1.dev12+g1234abc")},
			want: full, why: map[string]string{"bidirectional": "not observable"}},
		{name: "before return_token_ids (v0.10.1)", opts: []kvroutetest.Option{kvroutetest.WithVersion("0.10.1")},
			want: merge(full, map[string]capability.State{"return_token_ids": A, "handles_responses": A, "handles_messages": A,
				"stream_handles_responses": A, "bidirectional": A})},
		{name: "no /version", opts: []kvroutetest.Option{kvroutetest.WithVersion("")},
			want: merge(full, map[string]capability.State{"version": A, "return_token_ids": U, "handles_chat": U,
				"handles_completions": U, "handles_responses": U, "handles_messages": U, "stream_handles_responses": U}),
			why: map[string]string{"version": "GET /version: 404", "return_token_ids": "version unknown"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := kvroutetest.NewEngine(t, tc.opts...)
			r := probe(t, e.URL())
			require.True(t, r.Reachable, r.Error)
			assert.Equal(t, tc.want, states(r), r.Summary())
			for name, sub := range tc.why {
				f, ok := r.Fact(name)
				require.True(t, ok, name)
				assert.Contains(t, f.Why, sub, name)
			}
			for name, sub := range tc.fix {
				f, _ := r.Fact(name)
				assert.Contains(t, f.Fix, sub, name)
			}
			for _, n := range r.Facts() {
				assert.NotEmpty(t, n.Fact.Why, "%s has no reason", n.Name)
				if n.Fact.State == A && n.Name != "version" && n.Name != "metrics" {
					assert.NotEmpty(t, n.Fact.Fix, "%s is absent without a fix", n.Name)
				}
			}
			if tc.check != nil {
				tc.check(t, r)
			}
		})
	}
}

// newFake serves each path with a handler of the test's (404
// {"detail":"Not Found"} for the others) and records what it was sent.
func newFake(t *testing.T, routes map[string]http.HandlerFunc) (*httptest.Server, chan *http.Request) {
	t.Helper()
	seen := make(chan *http.Request, 64)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body := make([]byte, 4096)
		n, _ := r.Body.Read(body)
		r2 := r.Clone(context.Background())
		r2.ContentLength = int64(n)
		seen <- r2
		if h, ok := routes[r.URL.Path]; ok {
			h(w, r)
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write([]byte(`{"detail":"Not Found"}`))
	}))
	t.Cleanup(srv.Close)
	return srv, seen
}

func reply(status int, body string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(status)
		_, _ = w.Write([]byte(body))
	}
}

// TestProbeAnswersItDoesNotUnderstand: whatever an engine answers, the
// probe concludes Absent only on the evidence that means it, and Unknown
// otherwise, with the answer as the reason.
func TestProbeAnswersItDoesNotUnderstand(t *testing.T) {
	modelMissing := reply(404, `{"error":{"message":"The model `+"`x`"+` does not exist.","type":"NotFoundError","param":null,"code":404}}`)
	cases := []struct {
		name   string
		routes map[string]http.HandlerFunc
		want   map[string]capability.State
		why    map[string]string
	}{
		{"a 404 naming a model is no missing route", map[string]http.HandlerFunc{
			"/version": reply(200, `{"version":"0.30.0"}`), "/v1/chat/completions/render": modelMissing, "/tokenize": modelMissing,
		}, map[string]capability.State{"render_chat": U, "tokenize": U, "render_completions": A},
			map[string]string{"render_chat": "404 \"The model `x` does not exist.\""}},
		{"200 without the payload", map[string]http.HandlerFunc{
			"/version": reply(200, `not json`), "/v1/completions/render": reply(200, `[{"request_id":"x"}]`),
			"/v1/chat/completions/render": reply(200, `{"token_ids":null}`), "/tokenize": reply(200, `{"count":1}`),
		}, map[string]capability.State{"version": U, "render_completions": U, "render_chat": U, "tokenize": U, "return_token_ids": U},
			map[string]string{"version": "without a version", "render_completions": "without token_ids"}},
		{"completions render as one object", map[string]http.HandlerFunc{
			"/version": reply(200, `{"version":"0.30.0"}`), "/v1/completions/render": reply(200, `{"token_ids":[1,2]}`),
		}, map[string]capability.State{"render_completions": P}, nil},
		{"an engine that wants a key", map[string]http.HandlerFunc{
			"/version": reply(200, `{"version":"0.30.0"}`), "/v1/messages/render": reply(401, `{"error":"Unauthorized"}`),
		}, map[string]capability.State{"render_messages": U}, map[string]string{"render_messages": "OPENAI_API_KEY"}},
		{"a server error", map[string]http.HandlerFunc{
			"/version": reply(500, `Internal Server Error`), "/metrics": reply(503, ``),
		}, map[string]capability.State{"version": U, "metrics": U, "prefix_caching": U, "bidirectional": U},
			map[string]string{"version": "GET /version: 500", "metrics": "GET /metrics: 503"}},
		{"metrics without the cache gauge", map[string]http.HandlerFunc{
			"/metrics": reply(200, "# HELP x\nprocess_start_time_seconds 1.7e+09\n"),
		}, map[string]capability.State{"metrics": A, "prefix_caching": U}, map[string]string{"prefix_caching": "no vllm:cache_config_info"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			srv, _ := newFake(t, tc.routes)
			r := probe(t, srv.URL)
			require.True(t, r.Reachable)
			got := states(r)
			for name, s := range tc.want {
				assert.Equal(t, s, got[name], "%s: %s", name, func() string { f, _ := r.Fact(name); return f.Why }())
			}
			for name, sub := range tc.why {
				f, _ := r.Fact(name)
				assert.Contains(t, f.Why, sub, name)
			}
		})
	}
}

// TestProbeBounded: a probe sends small bodies, reads bounded answers,
// pins the endpoint's rank, sends the key, and ends at its deadline with
// every fact unknown when the engine never answers.
func TestProbeBounded(t *testing.T) {
	t.Run("requests", func(t *testing.T) {
		srv, seen := newFake(t, map[string]http.HandlerFunc{
			"/v1/models": reply(200, `{"object":"list","data":[{"id":"Qwen","object":"model","max_model_len":32768}]}`),
		})
		ep, err := transport.ParseEndpoint(srv.URL)
		require.NoError(t, err)
		ep.Rank = 3
		tr := &http.Transport{}
		defer tr.CloseIdleConnections()
		r := capability.Probe(context.Background(), tr, ep, capability.WithAPIKey("sk-engine"))
		assert.Equal(t, "Qwen", r.Model)
		assert.Equal(t, 32768, r.MaxModelLen)
		assert.Equal(t, srv.URL+" (rank 3)", r.Endpoint)
		close(seen)
		n := 0
		for req := range seen {
			n++
			assert.Equal(t, "3", req.Header.Get(transport.RankHeader), req.URL.Path)
			assert.Equal(t, "Bearer sk-engine", req.Header.Get("Authorization"), req.URL.Path)
			assert.Equal(t, capability.UserAgent, req.Header.Get("User-Agent"), req.URL.Path)
			assert.Less(t, req.ContentLength, int64(256), req.URL.Path)
			if req.Method == http.MethodPost && req.URL.Path != "/tokenize" {
				assert.True(t, strings.HasSuffix(req.URL.Path, "/render"), req.URL.Path)
			}
		}
		assert.Equal(t, 8, n, "version, models, metrics, 4 renders, tokenize")
	})
	t.Run("an engine that never answers", func(t *testing.T) {
		srv, _ := newFake(t, map[string]http.HandlerFunc{"/version": func(w http.ResponseWriter, r *http.Request) { <-r.Context().Done() }})
		r := probe(t, srv.URL, capability.WithTimeout(200*time.Millisecond))
		assert.False(t, r.Version.Is(P))
		assert.Contains(t, r.Version.Why, "deadline")
	})
	t.Run("nothing listening", func(t *testing.T) {
		srv := httptest.NewServer(http.NotFoundHandler())
		url := srv.URL
		srv.Close()
		r := probe(t, url)
		assert.False(t, r.Reachable)
		assert.NotEmpty(t, r.Error)
		assert.True(t, strings.HasPrefix(r.Summary(), "unreachable: "), r.Summary())
		for _, n := range r.Facts() {
			assert.NotEqual(t, P, n.Fact.State, n.Name)
		}
	})
	t.Run("metrics of vLLM's size", func(t *testing.T) {
		var b strings.Builder
		for i := range 20000 { // about 1 MiB of histogram lines before the gauge
			fmt.Fprintf(&b, "vllm:e2e_request_latency_seconds_bucket{le=\"%d.0\",model_name=\"m\"} 0.0\n", i)
		}
		b.WriteString("# a line longer than the scanner's bound is skipped\n" + strings.Repeat("x", 80<<10) + "\n")
		b.WriteString(`vllm:cache_config_info{block_size="64",enable_prefix_caching="False",engine="0",model_name="m \"q\"",num_gpu_blocks="101"} 1.0` + "\n")
		b.WriteString(`vllm:cache_config_info{block_size="64",enable_prefix_caching="False",engine="1",num_gpu_blocks="101"} 1.0` + "\n")
		srv, _ := newFake(t, map[string]http.HandlerFunc{"/metrics": reply(200, b.String())})
		r := probe(t, srv.URL)
		assert.Equal(t, 64, r.BlockSize)
		assert.Equal(t, int64(6400), r.KVCacheTokens)
		assert.Equal(t, A, r.PrefixCaching.State)
	})
}

// TestReportJSON: the JSON form carries every fact under its name.
func TestReportJSON(t *testing.T) {
	e := kvroutetest.NewEngine(t, kvroutetest.WithRenderRoutes(false))
	r := probe(t, e.URL())
	b, err := json.Marshal(r)
	require.NoError(t, err)
	var m map[string]any
	require.NoError(t, json.Unmarshal(b, &m))
	assert.Equal(t, "absent", m["render"].(map[string]any)["chat"].(map[string]any)["state"])
	assert.Equal(t, "present", m["tokenize"].(map[string]any)["state"])
	assert.Equal(t, float64(16), m["block_size"])
	assert.Contains(t, m, "process_start")
	var back capability.Report
	require.NoError(t, json.Unmarshal(b, &back))
	assert.Equal(t, r.Facts(), back.Facts())
}

// TestSummary: one line that names what works, what does not and why.
func TestSummary(t *testing.T) {
	e := kvroutetest.NewEngine(t, kvroutetest.WithRenderRoutes(false), kvroutetest.WithPrefixCaching(false))
	s := probe(t, e.URL()).Summary()
	assert.NotContains(t, s, "\n")
	assert.True(t, strings.HasPrefix(s, "vLLM "+kvroutetest.DefaultVersion+", model sim-model, KV 131k tokens (8193 blocks of 16)"), s)
	assert.Contains(t, s, "works: version tokenize return_token_ids handles stream_handles_responses metrics;")
	assert.Contains(t, s, "missing: render (404: route not registered (vllm serve without --enable-scale-out))")
	assert.Contains(t, s, "prefix_caching (vllm:cache_config_info enable_prefix_caching=False)")
	assert.Contains(t, s, "unknown: stream_handles_chat stream_handles_completions bidirectional")
}

// TestLearn: what turns show replaces what the probe concluded.
func TestLearn(t *testing.T) {
	var r capability.Report
	assert.True(t, r.Learn(capability.StreamHandlesName(capability.Chat), capability.Fact{State: P, Why: "a stream ended with a handle"}))
	assert.True(t, r.StreamHandles.Chat.Is(P))
	assert.False(t, r.Learn("nonsense", capability.Fact{}))
	for _, n := range r.Facts() {
		_, ok := r.Fact(n.Name)
		assert.True(t, ok, n.Name)
		assert.True(t, r.Learn(n.Name, capability.Fact{State: A}), n.Name)
	}
	for _, n := range r.Facts() {
		assert.Equal(t, A, n.Fact.State, n.Name)
	}
}

func TestParseVersion(t *testing.T) {
	cases := []struct {
		in   string
		want capability.Version
		ok   bool
	}{
		{"0.30.0", capability.Version{Major: 0, Minor: 30, Patch: 0}, true},
		{"v0.10.2", capability.Version{Major: 0, Minor: 10, Patch: 2}, true},
		{"0.11.1rc2.dev123+g0a1b2c3", capability.Version{Major: 0, Minor: 11, Patch: 1, Pre: true}, true},
		{"0.29.0+cu129", capability.Version{Major: 0, Minor: 29}, true},
		{"0.9.2.post1", capability.Version{Major: 0, Minor: 9, Patch: 2}, true},
		{"0.9.2.dev5", capability.Version{Major: 0, Minor: 9, Patch: 2, Pre: true}, true},
		{"1.2", capability.Version{Major: 1, Minor: 2}, true},
		{"dev", capability.Version{}, false},
		{"", capability.Version{}, false},
		{"1", capability.Version{}, false},
	}
	for _, tc := range cases {
		v, ok := capability.ParseVersion(tc.in)
		assert.Equal(t, tc.ok, ok, tc.in)
		assert.Equal(t, tc.want, v, tc.in)
	}
	v, _ := capability.ParseVersion("0.21.0rc1")
	assert.Equal(t, capability.Unknown, v.Has(capability.SinceBidirectional))
	v, _ = capability.ParseVersion("0.21.1rc1")
	assert.Equal(t, capability.Present, v.Has(capability.SinceBidirectional))
	v, _ = capability.ParseVersion("0.20.9")
	assert.Equal(t, capability.Absent, v.Has(capability.SinceBidirectional))
}

// TestRefresh: a refresh costs one /metrics read and keeps what was
// learned; a restart, or an engine that went away, brings a full probe.
func TestRefresh(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	ep, err := transport.ParseEndpoint(e.URL())
	require.NoError(t, err)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	ctx := context.Background()

	first, full := capability.Refresh(ctx, tr, ep, nil)
	require.True(t, full)
	learned := capability.Fact{State: P, Why: "a chat stream ended with a handle"}
	first.Learn(capability.StreamHandlesName(capability.Chat), learned)
	renders := e.Stats().RenderRequests

	next, full := capability.Refresh(ctx, tr, ep, first)
	assert.False(t, full)
	assert.Equal(t, learned, next.StreamHandles.Chat)
	assert.Equal(t, first.Facts(), next.Facts())
	assert.Equal(t, renders, e.Stats().RenderRequests, "a refresh renders nothing")

	e.Restart()
	again, full := capability.Refresh(ctx, tr, ep, next)
	assert.True(t, full, "a new process_start_time_seconds")
	assert.True(t, again.StreamHandles.Chat.Is(U), "learned facts of the old process are dropped")
	assert.Greater(t, e.Stats().RenderRequests, renders)

	e.Close()
	gone, full := capability.Refresh(ctx, tr, ep, again)
	assert.True(t, full)
	assert.False(t, gone.Reachable)
}

// TestImplausibleMetrics: values of /metrics no real engine reports (a
// block count whose capacity overflows, a process start a day ahead) are
// not taken: a first probe leaves them unknown, a refresh keeps the last
// plausible ones (and sees no restart), and the report lists them.
func TestImplausibleMetrics(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	u, err := url.Parse(e.URL())
	require.NoError(t, err)
	var hostile atomic.Bool
	rp := httputil.NewSingleHostReverseProxy(u)
	front := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/metrics" || !hostile.Load() {
			rp.ServeHTTP(w, r)
			return
		}
		fmt.Fprintf(w, "process_start_time_seconds %d\n", time.Now().Add(24*time.Hour).Unix())
		fmt.Fprintln(w, `vllm:cache_config_info{block_size="8",enable_prefix_caching="True",engine="0",num_gpu_blocks="2305843009213693954"} 1.0`)
	}))
	t.Cleanup(front.Close)
	ep, err := transport.ParseEndpoint(front.URL)
	require.NoError(t, err)
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	ctx := context.Background()

	good, full := capability.Refresh(ctx, tr, ep, nil)
	require.True(t, full)
	require.Equal(t, 16, good.BlockSize)
	require.Empty(t, good.Implausible)

	hostile.Store(true)
	next, full := capability.Refresh(ctx, tr, ep, good)
	assert.False(t, full, "no restart seen in an implausible start")
	assert.Equal(t, good.ProcessStart, next.ProcessStart)
	assert.Equal(t, good.BlockSize, next.BlockSize)
	assert.Equal(t, good.KVCacheTokens, next.KVCacheTokens)
	assert.True(t, next.Metrics.Is(P), next.Metrics.Why)
	require.Len(t, next.Implausible, 2)
	assert.Contains(t, next.Implausible[0], `process_start_time_seconds="`)
	assert.Contains(t, next.Implausible[0], "in the future")
	assert.Equal(t, `num_gpu_blocks="2305843009213693954" (above 2147483647)`, next.Implausible[1])
	assert.Contains(t, next.Metrics.Why, "implausible values ignored")
	assert.Contains(t, next.Summary(), "; implausible /metrics values ignored: ")

	first := probe(t, front.URL)
	assert.Zero(t, first.BlockSize)
	assert.Zero(t, first.KVCacheTokens)
	assert.True(t, first.ProcessStart.IsZero())
	assert.Len(t, first.Implausible, 2)
	assert.True(t, first.Metrics.Is(A), first.Metrics.Why)
}

// MaxModelLen reads GET /v1/models: the largest max_model_len listed (the
// served model and its LoRA adapters share the engine's), false when none.
func TestMaxModelLen(t *testing.T) {
	for _, tc := range []struct {
		body string
		want int
		ok   bool
	}{
		{`{"object":"list","data":[{"id":"m","max_model_len":32768},{"id":"lora","max_model_len":32768}]}`, 32768, true},
		{`{"data":[{"id":"m","max_model_len":4096},{"id":"x"}]}`, 4096, true},
		{`{"data":[{"id":"m"}]}`, 0, false},
		{`{"data":[]}`, 0, false},
		{`not json`, 0, false},
	} {
		n, ok := capability.MaxModelLen([]byte(tc.body))
		assert.Equal(t, tc.want, n, tc.body)
		assert.Equal(t, tc.ok, ok, tc.body)
	}
}

// TestProbeCPUTier: an engine with the offloading connector shows it by
// its vllm:kv_offload_* series, its hash algorithm in cache_config_info,
// and its byte counters move as it stores; one without shows none.
func TestProbeCPUTier(t *testing.T) {
	plain := probe(t, kvroutetest.NewEngine(t).URL())
	assert.Equal(t, capability.Absent, plain.KVOffload.State, plain.KVOffload.Why)
	assert.Equal(t, "sha256", plain.HashAlgo)

	e := kvroutetest.NewEngine(t, kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: 64, HashAlgo: "xxhash"}),
		kvroutetest.WithProfile(kvroutetest.Profile{KVBytesPerToken: 100}))
	before := probe(t, e.URL())
	assert.Equal(t, capability.Present, before.KVOffload.State, before.KVOffload.Why)
	assert.Equal(t, "xxhash", before.HashAlgo)
	assert.Zero(t, before.OffloadStoreBytes)
	resp, err := http.Post(e.URL()+"/v1/completions", "application/json",
		strings.NewReader(`{"model":"sim-model","prompt":"`+strings.Repeat("word ", 40)+`","max_tokens":1}`))
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	after := probe(t, e.URL())
	assert.Greater(t, after.OffloadStoreBytes, 0.0, "the prompt's whole blocks were written through")
	assert.Zero(t, int64(after.OffloadStoreBytes)%(16*100), "whole 16-token blocks of 100 bytes a token")
	assert.Zero(t, after.OffloadLoadBytes)
}
