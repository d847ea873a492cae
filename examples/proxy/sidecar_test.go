package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
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
	ctx, cancel := context.WithCancel(context.Background())
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	base := []string{"sidecar", "--host", "127.0.0.1", "--port", "0", "--health-interval", "1h",
		"--secure-proxy=false", "--local-host", u.Hostname(), "--model-server-port", u.Port()}
	done := make(chan error, 1)
	go func() { done <- run(ctx, append(base, args...), noEnv, stdout, stderr) }()
	p := &inproc{stdout: stdout, stderr: stderr, client: &http.Client{Transport: &http.Transport{}}}
	t.Cleanup(func() {
		p.client.CloseIdleConnections()
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Error("the sidecar did not stop")
		}
		if t.Failed() {
			t.Logf("sidecar stderr:\n%s", stderr.String())
		}
	})
	for range 1000 {
		if m := sidecarReady.FindStringSubmatch(stdout.String()); m != nil {
			p.url = m[1]
			p.addr = strings.TrimPrefix(p.url, "http://")
			return p
		}
		select {
		case err := <-done:
			done <- err
			require.FailNow(t, "the sidecar stopped", "%v\n%s", err, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	require.FailNow(t, "the sidecar did not print its ready line")
	return nil
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
	for _, e := range append(pods.cl.Prefill, pods.cl.Decode...) {
		assert.Zero(t, e.Stats().WrongOutputs)
	}
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
