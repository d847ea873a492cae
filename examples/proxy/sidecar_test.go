package main

import (
	"crypto/tls"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/url"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

var sidecarReady = regexp.MustCompile(`sidecar: serving (https?://\S+) decode`)

// startSidecar runs `bidikv-proxy sidecar` in this process on 127.0.0.1
// with the local engine at local (its URL), plain HTTP (--secure-proxy
// false) unless args say otherwise, and stops it when the test ends.
func startSidecar(t *testing.T, local string, args ...string) *inproc {
	t.Helper()
	u, err := url.Parse(local)
	require.NoError(t, err)
	base := []string{"sidecar", "--host", "127.0.0.1", "--port", "0", "--health-interval", "1h",
		"--secure-proxy=false", "--local-host", u.Hostname(), "--model-server-port", u.Port()}
	return runInProcess(t, append(base, args...), noEnv, sidecarReady, "sidecar")
}

// hostPort is an engine's host:port, as the endpoint picker names it.
func hostPort(t *testing.T, engineURL string) string {
	t.Helper()
	u, err := url.Parse(engineURL)
	require.NoError(t, err)
	return u.Host
}

// picker stands in for llm-d's endpoint picker behind Envoy: each request
// goes to the next decode pod's sidecar in turn, with the next prefill
// engine in x-prefiller-host-port.
type picker struct {
	mu        sync.Mutex
	n         int
	sidecars  []string // host:port
	prefills  []string // host:port
	noHeader  bool
	next      http.RoundTripper
	decodedOn []int // the sidecar of each request
}

func (p *picker) RoundTrip(req *http.Request) (*http.Response, error) {
	p.mu.Lock()
	i := p.n
	p.n++
	p.decodedOn = append(p.decodedOn, i%len(p.sidecars))
	p.mu.Unlock()
	req = req.Clone(req.Context())
	req.URL.Host = p.sidecars[i%len(p.sidecars)]
	req.Host = req.URL.Host
	// Each request's id names it, so that the engines' records show
	// which request each leg belongs to.
	req.Header.Set("X-Request-Id", fmt.Sprintf("pick-%d", i))
	if !p.noHeader {
		req.Header.Set("x-prefiller-host-port", p.prefills[(i/2)%len(p.prefills)])
	}
	return p.next.RoundTrip(req)
}

// redisServer starts redis-server on a free port for the test, or skips
// it when redis-server is not installed (outside CI).
func redisServer(t *testing.T) string {
	t.Helper()
	bin, err := exec.LookPath("redis-server")
	if err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server not installed: %v", err)
		}
		t.Skipf("redis-server not installed (%v): the sidecars' shared store is not tested", err)
	}
	for range 5 {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
		_ = ln.Close()
		cmd := exec.Command(bin, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no")
		require.NoError(t, cmd.Start())
		waited := make(chan struct{})
		go func() { _ = cmd.Wait(); close(waited) }()
		t.Cleanup(func() { _ = cmd.Process.Kill(); <-waited })
		for range 200 {
			if c, err := net.Dial("tcp", "127.0.0.1:"+port); err == nil {
				_ = c.Close()
				return "redis://127.0.0.1:" + port + "/0"
			}
			select {
			case <-waited:
			case <-time.After(10 * time.Millisecond):
				continue
			}
			break
		}
	}
	t.Fatal("redis-server did not start")
	return ""
}

// sidecarPods is a simulated llm-d P/D setup: two prefill engines the
// picker names by header, two decode pods each with its engine and its
// sidecar, the sidecars sharing Redis (or not).
type sidecarPods struct {
	cl       *kvroutetest.Cluster
	sidecars []*inproc
	client   *http.Client
	pick     *picker
}

func newSidecarPods(t *testing.T, redisURL string, extra ...string) *sidecarPods {
	t.Helper()
	cl := kvroutetest.NewCluster(t, 2, 2)
	pods := &sidecarPods{cl: cl}
	for i, d := range cl.Decode {
		args := append([]string{"--decode", cl.Decode[1-i].URL()}, extra...)
		if redisURL != "" {
			args = append(args, "--redis-url", redisURL)
		}
		pods.sidecars = append(pods.sidecars, startSidecar(t, d.URL(), args...))
	}
	pods.pick = &picker{next: &http.Transport{}}
	for _, s := range pods.sidecars {
		pods.pick.sidecars = append(pods.pick.sidecars, s.addr)
	}
	for _, p := range cl.Prefill {
		pods.pick.prefills = append(pods.pick.prefills, hostPort(t, p.URL()))
	}
	pods.client = &http.Client{Transport: pods.pick}
	t.Cleanup(pods.client.CloseIdleConnections)
	return pods
}

// The simulated llm-d setup with Redis: conversations of the four APIs,
// each turn on the other decode pod than the turn before and with a
// prefill engine the picker names, reuse from turn 2 (the next sidecar
// attaches the handle the other one retained in Redis), answer as a
// single engine would, and no handle reaches a client.
func TestSidecarPodsShareRedis(t *testing.T) {
	pods := newSidecarPods(t, redisServer(t))
	cases := []struct {
		name   string
		client agentClient
		hits   bool
	}{
		{"chat", agentClient{path: "/v1/chat/completions", base: chatAgentBody()}, true},
		// vLLM's chat streams carry no handle without PR #40186 (nor do
		// the simulated engines', by default): answered, not reused.
		{"chat stream", agentClient{path: "/v1/chat/completions", stream: true, base: chatAgentBody()}, false},
		{"responses", agentClient{path: "/v1/responses", base: codexBody("sidecar-codex")}, true},
		{"responses stream", agentClient{path: "/v1/responses", stream: true, base: codexBody("sidecar-codex-stream")}, true},
		{"messages", agentClient{path: "/v1/messages", base: claudeBody("sidecar")}, true},
		// vLLM's Messages streams carry no handle: nothing to reuse.
		{"messages stream", agentClient{path: "/v1/messages", stream: true, base: claudeBody("sidecar-stream")}, false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := tc.client
			c.session = tc.name
			runAgentTurns(t, &c, pods.client, "http://picker", tc.name, 4, tc.hits)
		})
	}
	t.Run("completions", func(t *testing.T) {
		runCompletions(t, pods.client, "http://picker", 4)
	})
	// Both sidecars served turns, and each attached handles the other
	// retained.
	for i, s := range pods.sidecars {
		hits := s.metric(t, "bidikv_reuse_hits_total")
		n, err := strconv.Atoi(hits)
		require.NoError(t, err, hits)
		assert.Positive(t, n, "sidecar %d attached handles", i)
	}
	// Every prefill leg went to an engine the header named, every decode
	// leg to a sidecar's local engine: both of each served their role.
	for i, e := range pods.cl.Prefill {
		assert.Positive(t, roles(e)["prefill"], "prefill engine %d", i)
		assert.Zero(t, roles(e)["decode"], "prefill engine %d", i)
	}
	for i, e := range pods.cl.Decode {
		assert.Positive(t, roles(e)["decode"], "decode engine %d", i)
		assert.Zero(t, roles(e)["prefill"], "decode engine %d", i)
	}
	// Each leg went to the engine its request named: the prefill leg of
	// request i to the prefill engine of its header, its decode leg to the
	// local engine of the sidecar the picker sent it to.
	legs := 0
	for k, e := range append(pods.cl.Prefill, pods.cl.Decode...) {
		for _, r := range e.Requests() {
			var i int
			if _, err := fmt.Sscanf(r.RequestID, "pick-%d", &i); err != nil || (r.Role != "prefill" && r.Role != "decode") {
				continue
			}
			legs++
			if r.Role == "prefill" {
				assert.Equal(t, pods.pick.prefills[(i/2)%2], hostPort(t, e.URL()), "request %d's prefill leg", i)
			} else {
				assert.Equal(t, i%2, k-len(pods.cl.Prefill), "request %d's decode leg on its sidecar's engine", i)
			}
		}
	}
	assert.Greater(t, legs, 40)
	for _, e := range append(pods.cl.Prefill, pods.cl.Decode...) {
		assert.Zero(t, e.Stats().WrongOutputs)
		for _, r := range e.Requests() {
			assert.Empty(t, r.Header.Get("X-Prefiller-Host-Port"), "the picker's header is removed before any engine sees it")
		}
	}
}

// apiRequests are an engine's requests on the chat API (no render, no
// capability probe).
func apiRequests(e *kvroutetest.Engine) []kvroutetest.RequestRecord {
	var out []kvroutetest.RequestRecord
	for _, r := range e.Requests() {
		if r.Path == "/v1/chat/completions" {
			out = append(out, r)
		}
	}
	return out
}

// roles counts an engine's completion requests by role.
func roles(e *kvroutetest.Engine) map[string]int {
	out := map[string]int{}
	for _, r := range e.Requests() {
		out[r.Role]++
	}
	return out
}

// runCompletions runs a completions conversation: each prompt is the one
// before, its answer and a new question; every turn after the first hits.
func runCompletions(t *testing.T, client *http.Client, base string, turns int) {
	t.Helper()
	prompt := agentSystem + "\nQuestion: what should the agent do first?\nAnswer:"
	for i := range turns {
		body, err := json.Marshal(map[string]any{"model": "sim-model", "prompt": prompt, "max_tokens": 16})
		require.NoError(t, err)
		resp, err := client.Post(base+"/v1/completions", "application/json", strings.NewReader(string(body)))
		require.NoError(t, err)
		var got struct {
			Choices []struct{ Text string } `json:"choices"`
			Usage   struct {
				Details *struct {
					Cached *int `json:"cached_tokens"`
				} `json:"prompt_tokens_details"`
			} `json:"usage"`
		}
		raw := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, raw)
		require.NoError(t, json.Unmarshal([]byte(raw), &got), raw)
		require.NotEmpty(t, got.Choices)
		assert.NotContains(t, raw, "kv_transfer_params")
		ref, err := kvroutetest.Reference("/v1/completions", body)
		require.NoError(t, err)
		assert.Equal(t, ref.Text, got.Choices[0].Text, "turn %d", i+1)
		want := "hit"
		if i == 0 {
			want = "miss"
		}
		assert.Equal(t, want, resp.Header.Get("X-Bidikv-Reuse"), "turn %d", i+1)
		require.NotNil(t, got.Usage.Details, "turn %d: cached_tokens rewritten to P's count, as llm-d's: %s", i+1, raw)
		require.NotNil(t, got.Usage.Details.Cached)
		prompt += got.Choices[0].Text + fmt.Sprintf("\nQuestion %d: and then?\nAnswer:", i+2)
	}
}

func readAll(t *testing.T, resp *http.Response) string {
	t.Helper()
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return string(b)
}

// A request without x-prefiller-host-port is served by the local engine
// alone, as llm-d's sidecar serves it: no prefill engine sees it, the
// answer is the single engine's with no handle, and the conversation's
// next turn with the header runs P then D.
func TestSidecarWithoutHeader(t *testing.T) {
	pods := newSidecarPods(t, "")
	pods.pick.noHeader = true
	body := plainChat(reuseSystem, "Which file should I read first?")
	for range 2 {
		resp, err := pods.client.Post("http://picker/v1/chat/completions", "application/json", strings.NewReader(body))
		require.NoError(t, err)
		raw := readAll(t, resp)
		require.Equal(t, http.StatusOK, resp.StatusCode, raw)
		assert.Equal(t, reference(t, []byte(body)), chatAnswer(t, raw))
		assert.NotContains(t, raw, "kv_transfer_params")
		assert.Empty(t, resp.Header.Get("X-Bidikv-Reuse"), "no turn of the router")
	}
	for i, e := range pods.cl.Prefill {
		got := roles(e)
		assert.Zero(t, got["plain"]+got["prefill"]+got["decode"], "prefill engine %d: %v", i, got)
	}
	for i, e := range pods.cl.Decode {
		got := roles(e)
		assert.Equal(t, []int{1, 0, 0}, []int{got["plain"], got["prefill"], got["decode"]}, "decode engine %d: %v", i, got)
		for _, r := range e.Requests() {
			assert.NotContains(t, string(r.Body), "kv_transfer_params", "a plain request")
		}
	}
	for _, s := range pods.sidecars {
		assert.Equal(t, "1", s.metric(t, `bidikv_sidecar_local_turns_total{path="/v1/chat/completions",reason="no_prefill_header"}`))
	}

	// A client's own kv_transfer_params never reach the engine.
	status, _, raw := pods.sidecars[0].do(t, http.MethodPost, "/v1/chat/completions",
		`{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"hi"}],"kv_transfer_params":{"do_remote_prefill":true,"remote_block_ids":[1]}}`)
	require.Equal(t, http.StatusOK, status, raw)
	reqs := pods.cl.Decode[0].Requests()
	assert.NotContains(t, string(reqs[len(reqs)-1].Body), "kv_transfer_params")

	// x-data-parallel-host-port naming no rank of the pod: 400, as llm-d.
	status, _, raw = pods.sidecars[0].do(t, http.MethodPost, "/v1/chat/completions", body, "X-Data-Parallel-Host-Port", "10.9.9.9:8000")
	assert.Equal(t, http.StatusBadRequest, status, raw)

	// With the header: P then D.
	pods.pick.noHeader = false
	resp, err := pods.client.Post("http://picker/v1/chat/completions", "application/json", strings.NewReader(body))
	require.NoError(t, err)
	raw = readAll(t, resp)
	require.Equal(t, http.StatusOK, resp.StatusCode, raw)
	assert.Equal(t, "miss", resp.Header.Get("X-Bidikv-Reuse"))
	assert.Equal(t, reference(t, []byte(body)), chatAnswer(t, raw))
}

// The sidecar's other routes: GET /health answers 200 itself; GET
// /metrics is the local engine's page followed by the sidecar's figures;
// any other path reaches the local engine (its /v1/models).
func TestSidecarRoutes(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	s := startSidecar(t, cl.Decode[0].URL())
	status, _, body := s.do(t, http.MethodGet, "/health", "")
	assert.Equal(t, http.StatusOK, status, body)
	status, _, body = s.do(t, http.MethodGet, "/metrics", "")
	require.Equal(t, http.StatusOK, status, body)
	assert.Regexp(t, `(?m)^vllm:`, body, "the local engine's metrics")
	for _, name := range []string{"bidikv_sidecar_held_tokens", "bidikv_sidecar_reclaimable_ratio", "bidikv_sidecar_budget_pressure"} {
		assert.Contains(t, body, "\n"+name+" ", name)
	}
	status, _, body = s.do(t, http.MethodGet, "/v1/models", "")
	assert.Equal(t, http.StatusOK, status, body)
	assert.Contains(t, body, "sim-model")
}

// --secure-proxy is on by default, as llm-d's: the sidecar serves TLS with
// a self-signed certificate.
func TestSidecarSecureByDefault(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	s := startSidecar(t, cl.Decode[0].URL(), "--secure-proxy=true")
	require.True(t, strings.HasPrefix(s.url, "https://"), s.url)
	s.client = &http.Client{Transport: &http.Transport{TLSClientConfig: &tls.Config{InsecureSkipVerify: true}}} //nolint:gosec // the self-signed certificate
	status, _, body := s.do(t, http.MethodPost, "/v1/chat/completions", plainChat(reuseSystem, "hi"), "x-prefiller-host-port", hostPort(t, cl.Prefill[0].URL()))
	require.Equal(t, http.StatusOK, status, body)
	assert.Equal(t, reference(t, []byte(plainChat(reuseSystem, "hi"))), chatAnswer(t, body))
}

// --enable-ssrf-protection: a header naming an engine outside the
// allowlist gets 403 with llm-d's words, and no engine sees the request;
// one inside it is served.
func TestSidecarSSRF(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 2, 1)
	s := startSidecar(t, cl.Decode[0].URL(), "--enable-ssrf-protection", "--inference-pool", "ns/pool",
		"--prefill", cl.Prefill[0].URL())
	body := plainChat(reuseSystem, "hi")
	status, _, raw := s.do(t, http.MethodPost, "/v1/chat/completions", body, "x-prefiller-host-port", "10.1.2.3:8000")
	assert.Equal(t, http.StatusForbidden, status, raw)
	assert.Contains(t, raw, "Forbidden: prefill target not allowed by SSRF protection")
	assert.Empty(t, apiRequests(cl.Decode[0]))
	assert.Equal(t, "1", s.metric(t, "bidikv_sidecar_ssrf_denied_total"))
	status, _, raw = s.do(t, http.MethodPost, "/v1/chat/completions", body, "x-prefiller-host-port", hostPort(t, cl.Prefill[1].URL()))
	require.Equal(t, http.StatusOK, status, raw, "the pool's hosts are allowed: the check is on hosts, as llm-d's")
}

// A prefill leg that fails with 503 is retried on the same engine up to
// --prefill-max-retries times; without retries the client gets the
// failure, naming the prefill phase.
func TestSidecarPrefillRetries(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 2, 1)
	p := hostPort(t, cl.Prefill[0].URL())
	body := plainChat(reuseSystem, "hi")

	s := startSidecar(t, cl.Decode[0].URL(), "--prefill-max-retries", "2", "--prefill-retry-backoff", "10ms")
	cl.Prefill[0].FailNext(2, http.StatusServiceUnavailable)
	status, _, raw := s.do(t, http.MethodPost, "/v1/chat/completions", body, "x-prefiller-host-port", p)
	require.Equal(t, http.StatusOK, status, raw)
	assert.Len(t, apiRequests(cl.Prefill[0]), 3, "two failures and the retry that worked, on the header's engine")
	assert.Empty(t, apiRequests(cl.Prefill[1]), "never another engine")

	s0 := startSidecar(t, cl.Decode[0].URL())
	cl.Prefill[0].FailNext(1, http.StatusServiceUnavailable)
	status, _, raw = s0.do(t, http.MethodPost, "/v1/chat/completions", body, "x-prefiller-host-port", p)
	assert.Contains(t, []int{http.StatusBadGateway, http.StatusServiceUnavailable}, status, raw)
	assert.Contains(t, raw, "prefill")
	assert.Empty(t, apiRequests(cl.Prefill[1]), "never another engine")
}

// The answer's usage.prompt_tokens_details.cached_tokens is the prefill
// engine's count, as llm-d's sidecar rewrites it. vLLM (and the simulated
// engines) answer prompt_tokens_details null unless run with
// --enable-prompt-tokens-details, which llm-d counts as 0: the client gets
// 0 where D's own answer had null.
func TestSidecarCachedTokens(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	s := startSidecar(t, cl.Decode[0].URL())
	p := hostPort(t, cl.Prefill[0].URL())
	status, _, raw := s.do(t, http.MethodPost, "/v1/chat/completions", plainChat(reuseSystem, "hi"), "x-prefiller-host-port", p)
	require.Equal(t, http.StatusOK, status, raw)
	assert.Contains(t, raw, `"prompt_tokens_details":{"cached_tokens":0}`)
	status, _, raw = s.do(t, http.MethodPost, "/v1/responses", `{"model":"sim-model","input":"hi","max_output_tokens":4}`, "x-prefiller-host-port", p)
	require.Equal(t, http.StatusOK, status, raw)
	assert.NotContains(t, raw, `"prompt_tokens_details"`, "Responses answers keep their own usage")

	// P's count, in a body and in a stream's usage chunk.
	rt := &legs{}
	rt.cached.Store(307)
	for _, tc := range []struct{ ct, in, want string }{
		{"application/json", `{"id":"x","usage":{"prompt_tokens":312,"prompt_tokens_details":null}}`,
			`{"id":"x","usage":{"prompt_tokens":312,"prompt_tokens_details":{"cached_tokens":307}}}`},
		{"application/json", `{"id":"x","usage":{"prompt_tokens":312,"prompt_tokens_details":{"cached_tokens":5,"audio_tokens":0}}}`,
			`{"id":"x","usage":{"prompt_tokens":312,"prompt_tokens_details":{"cached_tokens":307,"audio_tokens":0}}}`},
		{"text/event-stream", "data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":312}}\n\ndata: [DONE]\n\n",
			"data: {\"choices\":[]}\n\ndata: {\"choices\":[],\"usage\":{\"prompt_tokens\":312,\"prompt_tokens_details\":{\"cached_tokens\":307}}}\n\ndata: [DONE]\n\n"},
	} {
		rec := httptest.NewRecorder()
		w, finish := newCachedWriter(rec, rt, "/v1/chat/completions")
		w.Header().Set("Content-Type", tc.ct)
		w.WriteHeader(http.StatusOK)
		for _, part := range strings.SplitAfter(tc.in, "p") { // in pieces, lines cut anywhere
			_, err := w.Write([]byte(part))
			require.NoError(t, err)
		}
		finish()
		assert.Equal(t, tc.want, rec.Body.String())
	}
}

// llm-d's sidecar command line: accepted flags take llm-d's defaults and
// meanings; flags of features bidikv does not run, and flags neither
// sidecar knows, stop the start with an error naming them.
func TestSidecarFlags(t *testing.T) {
	env := func(m map[string]string) func(string) string { return func(k string) string { return m[k] } }
	s, err := parseSidecar(nil, noEnv, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, []any{8000, 8200, 1, "nixlv2", true, 0, 200 * time.Millisecond, "", "localhost"},
		[]any{s.port, s.modelServerPort, s.dpSize, s.kvConnector, s.secure, s.prefillRetries, s.prefillBackoff, s.host, s.localHost})
	assert.Equal(t, []string{"http://localhost:8200"}, s.localURLs())
	assert.True(t, s.localFallback, "P without a handle: D prefills, as llm-d sends D null kv_transfer_params")

	s, err = parseSidecar([]string{"--vllm-port", "9000", "--data-parallel-size", "2", "--enable-tls", "decoder"}, env(map[string]string{"POD_IP": "10.0.0.7"}), io.Discard)
	require.NoError(t, err)
	assert.Equal(t, []string{"https://10.0.0.7:9000", "https://10.0.0.7:9001"}, s.localURLs(), "--vllm-port alone sets the port, POD_IP the host")

	s, err = parseSidecar([]string{"--model-server-port", "8300", "--configuration", "port: 9100\nmodel-server-port: 8400\nprefill-max-retries: 2\nenable-prefiller-sampling: true"}, noEnv, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, []any{9100, 8300, 2, true}, []any{s.port, s.modelServerPort, s.prefillRetries, s.samplePrefill}, "the command line wins over the configuration")

	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--no-such-flag"}, "unknown flag --no-such-flag"},
		{[]string{"--kv-connector", "mooncake"}, "--kv-connector mooncake: bidikv's sidecar speaks NixlConnector's pull protocol (nixlv2) only"},
		{[]string{"--kv-connector", "lmcache"}, "--kv-connector must be one of: nixlv2, shared-storage, sglang, mooncake, offloading"},
		{[]string{"--ec-connector", "ec-nixl"}, "--ec-connector ec-nixl: bidikv's sidecar runs no encoder stage"},
		{[]string{"--enable-p2p-pull"}, "--enable-p2p-pull: bidikv's sidecar does not pull"},
		{[]string{"--decode-chunk-size", "64"}, "--decode-chunk-size 64"},
		{[]string{"--moriio-write-mode"}, "--moriio-write-mode true: MoRI-IO WRITE mode"},
		{[]string{"--enable-ssrf-protection"}, "--inference-pool flag or INFERENCE_POOL environment variable is required"},
		{[]string{"--enable-ssrf-protection", "--inference-pool", "p"}, "llm-d's sidecar watches the InferencePool \"p\" through the Kubernetes API"},
		{[]string{"--configuration", "no-such-key: 1"}, "field no-such-key not found"},
		{[]string{"--data-parallel-size", "0"}, "--data-parallel-size must be a positive integer"},
		{[]string{"--enable-tls", "router"}, "--enable-tls stages must be one of: prefiller, decoder, encoder"},
		{[]string{"--decode-local"}, "--decode-local: in the sidecar"},
	} {
		_, err := parseSidecar(tc.args, noEnv, io.Discard)
		require.ErrorIs(t, err, errUsage, "%v", tc.args)
		assert.ErrorContains(t, err, tc.want, "%v", tc.args)
	}

	var help strings.Builder
	_, err = parseSidecar([]string{"--help"}, noEnv, &help)
	require.ErrorIs(t, err, flag.ErrHelp)
	for _, name := range []string{"--port", "--model-server-port", "--vllm-port", "--kv-connector", "--secure-proxy", "--cert-path", "--enable-tls",
		"--tls-insecure-skip-verify", "--data-parallel-size", "--enable-ssrf-protection", "--inference-pool", "--metrics-port", "--tracing",
		"--configuration", "--configuration-file", "--enable-prefiller-sampling", "--prefill-max-retries", "--redis-url"} {
		assert.Regexp(t, "\n  "+name+"[ \n]", help.String(), name)
	}
}

// x-prefiller-host-port as llm-d reads it: one value, a comma-separated
// list or repeated headers; the first entry, or the sampled one with
// --enable-prefiller-sampling; removed from the request either way.
func TestSidecarPrefillHeader(t *testing.T) {
	for _, tc := range []struct {
		values []string
		sample bool
		want   string
	}{
		{nil, false, ""},
		{[]string{"10.0.0.1:8000"}, false, "10.0.0.1:8000"},
		{[]string{" 10.0.0.1:8000 , 10.0.0.2:8000"}, false, "10.0.0.1:8000"},
		{[]string{"10.0.0.1:8000", "10.0.0.2:8000"}, false, "10.0.0.1:8000"},
		{[]string{"10.0.0.1:8000,10.0.0.2:8000,10.0.0.3:8000"}, true, "10.0.0.3:8000"},
		{[]string{"10.0.0.1:8000", "10.0.0.2:8000"}, true, "10.0.0.2:8000"},
	} {
		sc := &sidecar{cfg: &sidecarConfig{samplePrefill: tc.sample}, sample: func(n int) int { return n - 1 }}
		r := httptest.NewRequest(http.MethodPost, "/v1/chat/completions", nil)
		for _, v := range tc.values {
			r.Header.Add("X-Prefiller-Host-Port", v)
		}
		assert.Equal(t, tc.want, sc.prefillTarget(r), "%q sample %v", tc.values, tc.sample)
		assert.Empty(t, r.Header.Values("X-Prefiller-Host-Port"))
	}
}

// --metrics-port serves the sidecar's own registry on a listener of its
// own, as llm-d's sidecar serves its metrics there.
func TestSidecarMetricsPort(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := strconv.Itoa(ln.Addr().(*net.TCPAddr).Port)
	require.NoError(t, ln.Close())
	s := startSidecar(t, cl.Decode[0].URL(), "--metrics-port", port)
	require.Eventually(t, func() bool {
		return strings.Contains(s.stdout.String(), "sidecar: serving http://127.0.0.1:"+port+" metrics")
	},
		5*time.Second, 10*time.Millisecond, s.stdout.String())
	resp, err := s.client.Get("http://127.0.0.1:" + port + "/metrics")
	require.NoError(t, err)
	page := readAll(t, resp)
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	assert.Contains(t, page, "bidikv_sidecar_held_tokens ")
	assert.NotRegexp(t, `(?m)^vllm:`, page, "bidikv's registry alone")
}

// With --decode-stream buffered (a proxy flag the sidecar takes), streamed
// Messages turns, whose vLLM streams never carry a handle, reuse across the
// pods too. (A chat stream is buffered once its decode engine's streams
// were seen to carry none: each sidecar learns it of its own engine.)
func TestSidecarBufferedStreams(t *testing.T) {
	pods := newSidecarPods(t, redisServer(t), "--decode-stream", "buffered")
	c := agentClient{path: "/v1/messages", stream: true, base: claudeBody("buffered"), session: "buffered-messages"}
	runAgentTurns(t, &c, pods.client, "http://picker", c.session, 4, true)
}
