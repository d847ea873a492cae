package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// kvConfig is the engines' --kv-transfer-config: NixlConnector in pull
// mode with bidirectional transfer, as vLLM documents it.
const kvConfig = `{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_recompute_threshold":64}}`

// bins builds the proxy and examples/vllmsim once per test binary. The
// builds inherit GOFLAGS, so a -modfile given there applies to them too.
var bins = sync.OnceValues(func() (string, error) {
	dir, err := os.MkdirTemp("", "bidikv-proxy-e2e")
	binDir = dir
	if err != nil {
		return "", err
	}
	for _, b := range []struct{ out, pkg string }{
		{"proxy", "."},
		{"vllmsim", "github.com/bidikv/bidikv/examples/vllmsim"},
	} {
		cmd := exec.Command("go", "build", "-o", filepath.Join(dir, b.out), b.pkg)
		if out, err := cmd.CombinedOutput(); err != nil {
			return "", fmt.Errorf("go build %s: %v\n%s", b.pkg, err, out)
		}
	}
	return dir, nil
})

// binDir is removed by TestMain.
var binDir string

// syncBuffer collects a child's stderr.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// proc is a child process on 127.0.0.1.
type proc struct {
	url    string
	line   string // its ready line
	cmd    *exec.Cmd
	stderr *syncBuffer
	done   chan error // receives Wait's result once
}

var (
	simReady   = regexp.MustCompile(`serving (http://\S+) side channel`)
	proxyReady = regexp.MustCompile(`proxy: serving (http://\S+)`)
)

// start runs a built binary and waits, bounded, for its ready line.
func start(t *testing.T, name string, ready *regexp.Regexp, args ...string) *proc {
	t.Helper()
	return startEnv(t, nil, name, ready, args...)
}

// startEnv is start with env ("KEY=value") added to the environment.
func startEnv(t *testing.T, env []string, name string, ready *regexp.Regexp, args ...string) *proc {
	t.Helper()
	dir, err := bins()
	require.NoError(t, err)
	p := &proc{cmd: exec.Command(filepath.Join(dir, name), args...), stderr: &syncBuffer{}, done: make(chan error, 1)}
	p.cmd.Env = append(append(os.Environ(), "OPENAI_API_KEY="), env...) // engines here take no key
	p.cmd.Stderr = p.stderr
	out, err := p.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, p.cmd.Start())
	lines := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(out).ReadString('\n')
		lines <- line
		_, _ = io.Copy(io.Discard, out)
	}()
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		_ = p.cmd.Process.Signal(syscall.SIGTERM)
		<-p.done
		if t.Failed() {
			t.Logf("%s stderr:\n%s", name, p.stderr.String())
		}
	})
	select {
	case line := <-lines:
		m := ready.FindStringSubmatch(line)
		require.NotNil(t, m, "%s did not start: %q\n%s", name, line, p.stderr.String())
		p.url, p.line = m[1], line
	case <-time.After(time.Minute):
		require.FailNow(t, name+" did not print its ready line")
	}
	return p
}

// kill stops a process at once, as a crashed engine.
func (p *proc) kill(t *testing.T) {
	t.Helper()
	require.NoError(t, p.cmd.Process.Kill())
	err := <-p.done
	p.done <- err // for the cleanup
}

func startEngine(t *testing.T, extra ...string) *proc {
	return start(t, "vllmsim", simReady, append([]string{"--port", "0", "--side-channel-port", "0",
		"--kv-transfer-config", kvConfig, "--stream-handles"}, extra...)...)
}

// startProxy starts the proxy with the reference proxy's own flags.
func startProxy(t *testing.T, p, d *proc, extra ...string) *proc {
	hp := func(raw string) (string, string) {
		u, err := url.Parse(raw)
		require.NoError(t, err)
		return u.Hostname(), u.Port()
	}
	ph, pp := hp(p.url)
	dh, dp := hp(d.url)
	return start(t, "proxy", proxyReady, append([]string{"--host", "127.0.0.1", "--port", "0",
		"--prefiller-host", ph, "--prefiller-port", pp, "--decoder-host", dh, "--decoder-port", dp,
		"--log-level", "debug"}, extra...)...)
}

// turn is one streamed answer as vLLM's multi-turn benchmark reads it.
type turn struct {
	status int
	reuse  string
	text   string
	done   bool // data: [DONE] arrived
	raw    string
}

// chatBody is a request as benchmark_serving_multi_turn.py sends it with
// --send-conversation-id.
func chatBody(msgs []map[string]string, maxTokens int, conv string) []byte {
	b, _ := json.Marshal(map[string]any{
		"model": "sim-model", "messages": msgs, "stream": true,
		"stream_options": map[string]any{"include_usage": false}, "max_tokens": maxTokens,
		"conversation_id": conv,
	})
	return b
}

func post(t *testing.T, base string, body []byte, conv string) *http.Response {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	t.Cleanup(cancel)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+"/v1/chat/completions", bytes.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("X-Session-ID", conv)
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	t.Cleanup(func() { _ = resp.Body.Close() })
	return resp
}

// readStream reads SSE events to the end of the body (the proxy's handler
// has returned, so the turn has been observed) and joins delta.content.
func readStream(t *testing.T, resp *http.Response, r *bufio.Reader) turn {
	t.Helper()
	out := turn{status: resp.StatusCode, reuse: resp.Header.Get("X-Bidikv-Reuse")}
	var raw strings.Builder
	for {
		line, err := r.ReadString('\n')
		raw.WriteString(line)
		if data, ok := strings.CutPrefix(strings.TrimRight(line, "\r\n"), "data: "); ok {
			if data == "[DONE]" {
				out.done = true
			} else {
				var c struct {
					Choices []struct {
						Delta struct{ Content string } `json:"delta"`
					} `json:"choices"`
				}
				require.NoError(t, json.Unmarshal([]byte(data), &c), data)
				for _, ch := range c.Choices {
					out.text += ch.Delta.Content
				}
			}
		}
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
	}
	out.raw = raw.String()
	return out
}

func get(t *testing.T, u string, header ...string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodGet, u, nil)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, string(b)
}

// metricValue finds the value of one sample in the Prometheus text page.
func metricValue(page, sample string) string {
	for _, l := range strings.Split(page, "\n") {
		if v, ok := strings.CutPrefix(l, sample+" "); ok {
			return v
		}
	}
	return "absent"
}

func reference(t *testing.T, body []byte) string {
	t.Helper()
	a, err := kvroutetest.Reference("/v1/chat/completions", body)
	require.NoError(t, err)
	return a.Text
}

// A multi-turn conversation through the proxy, sent as vLLM's benchmark
// sends it: hits from turn 2, the single-engine answers, matching metrics,
// and a graceful drain on SIGTERM with a stream in flight.
func TestConversationMetricsAndDrain(t *testing.T) {
	t.Parallel() // slow: real processes or a long stream
	// Modelled costs in real time, so the drained stream lasts a while.
	p := startEngine(t, "--profile", "qwen3-32b", "--speed", "1", "--no-enable-prefix-caching")
	d := startEngine(t, "--profile", "qwen3-32b", "--speed", "1")
	// A body deadline far shorter than the drained stream: it bounds the
	// body only, never the stream.
	px := startProxy(t, p, d, "--shutdown-grace", "30s", "--read-body-timeout", "1s")

	status, body := get(t, px.url+"/ready")
	require.Equal(t, http.StatusOK, status, body)

	const conv = "bench-conv-0"
	long := strings.Repeat("the quick brown fox jumps over the lazy dog and keeps running through the forest until nightfall ", 8)
	msgs := []map[string]string{{"role": "user", "content": long}}
	const turns = 4
	for i := range turns {
		b := chatBody(msgs, 12, conv)
		resp := post(t, px.url, b, conv)
		got := readStream(t, resp, bufio.NewReader(resp.Body))
		require.Equal(t, http.StatusOK, got.status, got.raw)
		assert.True(t, got.done, "turn %d ends with data: [DONE]", i+1)
		assert.Equal(t, reference(t, b), got.text, "turn %d answers as a single engine would", i+1)
		assert.NotContains(t, got.raw, "kv_transfer_params", "handles never reach the client")
		want := "hit"
		if i == 0 {
			want = "miss"
		}
		assert.Equal(t, want, got.reuse, "turn %d", i+1)
		msgs = append(msgs, map[string]string{"role": "assistant", "content": got.text},
			map[string]string{"role": "user", "content": fmt.Sprintf("and what happened on day %d of the journey?", i+2)})
	}

	status, page := get(t, px.url+"/metrics")
	require.Equal(t, http.StatusOK, status)
	for sample, want := range map[string]string{
		`bidikv_reuse_hits_total`: fmt.Sprint(turns - 1),
		`bidikv_turns_total{path="/v1/chat/completions",result="ok",reuse="hit"}`:  fmt.Sprint(turns - 1),
		`bidikv_turns_total{path="/v1/chat/completions",result="ok",reuse="miss"}`: "1",
		`bidikv_handles_stored_total`:                                 fmt.Sprint(turns),
		`bidikv_ttft_seconds_count{reuse="hit"}`:                      fmt.Sprint(turns - 1),
		`bidikv_ttft_seconds_count{reuse="miss"}`:                     "1",
		`bidikv_prefill_seconds_count{reuse="hit"}`:                   fmt.Sprint(turns - 1),
		`bidikv_decode_first_byte_seconds_count{reuse="miss"}`:        "1",
		`bidikv_handle_age_seconds_count`:                             fmt.Sprint(turns - 1),
		`bidikv_inflight_turns`:                                       "0",
		`bidikv_retained_handles`:                                     "1",
		`bidikv_stream_without_handle_total`:                          "0",
		`bidikv_endpoint_up{endpoint="` + p.url + `",role="prefill"}`: "1",
		`bidikv_endpoint_up{endpoint="` + d.url + `",role="decode"}`:  "1",
	} {
		assert.Equal(t, want, metricValue(page, sample), sample)
	}
	missLines := regexp.MustCompile(`(?m)^bidikv_reuse_misses_total\{reason="[a-z_]+"\} 1$`).FindAllString(page, -1)
	assert.Len(t, missLines, 1, "one miss, with its reason:\n%s", page)
	assert.NotContains(t, px.stderr.String(), long[:40], "prompts never reach the logs")

	t.Run("graceful drain", func(t *testing.T) {
		b := chatBody(msgs, 120, conv) // about 2.6 s of modelled decode
		resp := post(t, px.url, b, conv)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		r := bufio.NewReader(resp.Body)
		first, err := r.ReadString('\n')
		require.NoError(t, err)
		require.True(t, strings.HasPrefix(first, "data: "), first)

		require.NoError(t, px.cmd.Process.Signal(syscall.SIGTERM))
		addr := strings.TrimPrefix(px.url, "http://")
		refused := false
		for range 500 { // the listener closes at once; bounded wait for it
			c, err := net.DialTimeout("tcp", addr, time.Second)
			if err != nil {
				refused = true
				break
			}
			_ = c.Close()
			time.Sleep(5 * time.Millisecond)
		}
		assert.True(t, refused, "no new connections once draining")

		rest := readStream(t, resp, r)
		assert.True(t, rest.done, "the stream in flight completes")
		full := first + rest.raw
		var text strings.Builder
		for _, l := range strings.Split(full, "\n") {
			data, ok := strings.CutPrefix(l, "data: ")
			if !ok || data == "[DONE]" {
				continue
			}
			var c struct {
				Choices []struct {
					Delta struct{ Content string } `json:"delta"`
				} `json:"choices"`
			}
			require.NoError(t, json.Unmarshal([]byte(data), &c))
			for _, ch := range c.Choices {
				text.WriteString(ch.Delta.Content)
			}
		}
		assert.Equal(t, reference(t, b), text.String())
		select {
		case err := <-px.done:
			px.done <- err
			assert.NoError(t, err, "the proxy exits 0 after draining")
		case <-time.After(time.Minute):
			require.FailNow(t, "the proxy did not exit after draining")
		}
		assert.Contains(t, px.stderr.String(), "msg=drained")
	})
}

// /ready follows the engines, /v1/models comes from a healthy one, and
// inbound keys and the body limit answer in OpenAI's error shape.
func TestReadyAuthAndLimits(t *testing.T) {
	t.Parallel() // slow: real processes or a long stream
	p := startEngine(t)
	d := startEngine(t)
	px := startProxy(t, p, d, "--api-key", "sk-one", "sk-two", "--max-body-bytes", "2048")
	auth := []string{"Authorization", "Bearer sk-two"}

	status, body := get(t, px.url+"/health")
	assert.Equal(t, http.StatusOK, status, body)
	status, body = get(t, px.url+"/ready")
	assert.Equal(t, http.StatusOK, status, body)
	assertReady(t, body, true, true, true)

	t.Run("inbound keys", func(t *testing.T) {
		status, body := get(t, px.url+"/v1/models")
		assert.Equal(t, http.StatusUnauthorized, status)
		assert.JSONEq(t, `{"error":{"message":"proxy: invalid or missing API key","type":"authentication_error","param":null,"code":"invalid_api_key"}}`, body)
		status, _ = get(t, px.url+"/v1/models", "Authorization", "Bearer sk-three")
		assert.Equal(t, http.StatusUnauthorized, status)
		status, body = get(t, px.url+"/v1/models", auth...)
		assert.Equal(t, http.StatusOK, status, body)
		assert.Contains(t, body, `"sim-model"`)
	})

	t.Run("body limit", func(t *testing.T) {
		big := chatBody([]map[string]string{{"role": "user", "content": strings.Repeat("x", 4096)}}, 4, "")
		req, err := http.NewRequest(http.MethodPost, px.url+"/v1/chat/completions", bytes.NewReader(big))
		require.NoError(t, err)
		req.Header.Set(auth[0], auth[1])
		resp, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		assert.Equal(t, http.StatusRequestEntityTooLarge, resp.StatusCode)
		assert.Contains(t, string(b), `"type":"invalid_request_error"`)
	})

	t.Run("ready flips when an engine dies", func(t *testing.T) {
		d.kill(t)
		status, body := get(t, px.url+"/ready")
		assert.Equal(t, http.StatusServiceUnavailable, status)
		assertReady(t, body, false, true, false)
		_, page := get(t, px.url+"/metrics")
		assert.Equal(t, "0", metricValue(page, `bidikv_endpoint_up{endpoint="`+d.url+`",role="decode"}`))
		assert.Equal(t, "1", metricValue(page, `bidikv_endpoint_up{endpoint="`+p.url+`",role="prefill"}`))
		status, body = get(t, px.url+"/v1/models", auth...)
		assert.Equal(t, http.StatusOK, status, "models from the prefill engine still up: %s", body)
	})
}

// assertReady checks /ready's first fields, kept from before the engines'
// capabilities were added, and that it lists both engines.
func assertReady(t *testing.T, body string, ready, prefill, decode bool) {
	t.Helper()
	var r struct {
		Ready, Prefill, Decode *bool
		Engines                []struct{ Role, Endpoint string }
	}
	require.NoError(t, json.Unmarshal([]byte(body), &r), body)
	require.NotNil(t, r.Ready, body)
	require.NotNil(t, r.Prefill, body)
	require.NotNil(t, r.Decode, body)
	assert.Equal(t, []bool{ready, prefill, decode}, []bool{*r.Ready, *r.Prefill, *r.Decode}, body)
	assert.True(t, strings.HasPrefix(body, fmt.Sprintf(`{"ready":%t,"prefill":%t,"decode":%t,`, ready, prefill, decode)), body)
	require.Len(t, r.Engines, 2, body)
	assert.Equal(t, []string{"prefill", "decode"}, []string{r.Engines[0].Role, r.Engines[1].Role})
}

// A stream still open when the grace period ends gets an SSE error event
// (no data: [DONE]), the log says how many were cut, and the exit status
// is not 0.
func TestDrainCutsStreams(t *testing.T) {
	t.Parallel() // slow: real processes or a long stream
	p := startEngine(t, "--profile", "qwen3-32b", "--speed", "1", "--no-enable-prefix-caching")
	d := startEngine(t, "--profile", "qwen3-32b", "--speed", "1")
	px := startProxy(t, p, d, "--shutdown-grace", "300ms")

	b, err := json.Marshal(map[string]any{ // 400 tokens, about 9 s of modelled decode
		"model": "sim-model", "messages": []map[string]string{{"role": "user", "content": "tell me a long story about a fox"}},
		"stream": true, "max_tokens": 400, "ignore_eos": true,
	})
	require.NoError(t, err)
	resp := post(t, px.url, b, "c-cut")
	require.Equal(t, http.StatusOK, resp.StatusCode)
	r := bufio.NewReader(resp.Body)
	first, err := r.ReadString('\n')
	require.NoError(t, err)
	require.True(t, strings.HasPrefix(first, "data: "), first)

	start := time.Now()
	require.NoError(t, px.cmd.Process.Signal(syscall.SIGTERM))
	rest, err := io.ReadAll(r)
	require.NoError(t, err, "the stream ends cleanly after its error event")
	assert.Less(t, time.Since(start), 5*time.Second, "cut at the end of the grace period, not run to the end")
	assert.NotContains(t, string(rest), "data: [DONE]")
	assert.Regexp(t, `(?m)^data: \{"error":\{"code":"shutting_down","message":"proxy: [^"]+","param":null,"type":"server_error"\}\}$`, string(rest))

	select {
	case err := <-px.done:
		px.done <- err
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee, "the proxy exits non-zero")
		assert.Equal(t, 1, ee.ExitCode())
	case <-time.After(time.Minute):
		require.FailNow(t, "the proxy did not exit")
	}
	log := px.stderr.String()
	assert.Regexp(t, `level=ERROR msg="grace period over: cut turns in flight" cut=1`, log)
	assert.NotContains(t, log, "msg=drained")
}

// --key-mode conversation-id without inbound keys is refused at startup
// with a clear error and exit status 2.
func TestConversationIDWithoutKeysRefused(t *testing.T) {
	dir, err := bins()
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, filepath.Join(dir, "proxy"), "--port", "0", "--key-mode", "conversation-id")
	cmd.Env = append(os.Environ(), envAPIKeys+"=")
	out, err := cmd.CombinedOutput()
	var ee *exec.ExitError
	require.ErrorAs(t, err, &ee, "%s", out)
	assert.Equal(t, 2, ee.ExitCode())
	assert.Contains(t, string(out), "--key-mode conversation-id without inbound API keys")
	assert.Contains(t, string(out), "--allow-anonymous-conversation-id")
}
