package main

import (
	"bufio"
	"context"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

var debugReady = regexp.MustCompile(`profiler on (http://\S+)/debug/pprof/`)

func TestDebugAddr(t *testing.T) {
	p := startInProcess(t, nil, "--debug-addr", "127.0.0.1:0")
	m := debugReady.FindStringSubmatch(p.stdout.String())
	require.NotNil(t, m, "no profiler line in %q", p.stdout.String())
	get := func(url string) (int, string) {
		resp, err := p.client.Get(url)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		return resp.StatusCode, string(b)
	}
	status, body := get(m[1] + "/debug/pprof/")
	assert.Equal(t, http.StatusOK, status)
	assert.Contains(t, body, "goroutine")
	status, _ = get(m[1] + "/debug/pprof/heap?debug=1")
	assert.Equal(t, http.StatusOK, status)
	status, body = get(p.url + "/debug/pprof/")
	assert.Equal(t, http.StatusNotFound, status, "the profiler must not be on the proxy's port: %s", body)
}

// The command line holds secrets (--api-key, the password in --redis-url):
// the profiler of a real proxy process does not serve it, in any spelling.
func TestDebugAddrHidesCommandLine(t *testing.T) {
	if testing.Short() {
		t.Skip("builds and starts a process")
	}
	dir, err := bins()
	require.NoError(t, err)
	cmd := exec.Command(filepath.Join(dir, "proxy"), "--host", "127.0.0.1", "--port", "0", "--health-interval", "1h",
		"--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1", "--debug-addr", "127.0.0.1:0",
		"--api-key", "sk-secret-on-the-command-line", "--redis-url", "redis://:redis-password@127.0.0.1:1/0")
	cmd.Env = append(os.Environ(), "OPENAI_API_KEY=")
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	lines := make(chan string)
	go func() {
		defer close(lines)
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
	}()
	var debugURL string
	for debugURL == "" {
		select {
		case l, ok := <-lines:
			require.True(t, ok, "the proxy stopped before its profiler line")
			if m := debugReady.FindStringSubmatch(l); m != nil {
				debugURL = m[1]
			}
		case <-time.After(time.Minute):
			require.FailNow(t, "no profiler line")
		}
	}
	go func() {
		for range lines { // drain
		}
	}()
	for _, path := range []string{"/debug/pprof/cmdline", "/debug/pprof/cmdline?debug=1", "/debug/pprof//cmdline", "/debug/pprof/./cmdline", "/debug/pprof/%63mdline"} {
		resp, err := http.Get(debugURL + path)
		require.NoError(t, err, path)
		b, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		require.NoError(t, err)
		assert.NotEqual(t, http.StatusOK, resp.StatusCode, path)
		assert.NotContains(t, string(b), "sk-secret", path)
		assert.NotContains(t, string(b), "redis-password", path)
	}
	resp, err := http.Get(debugURL + "/debug/pprof/goroutine?debug=1")
	require.NoError(t, err)
	_ = resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode, "the profiles are served")
}

// The profiler has no authentication: a --debug-addr that is not a
// loopback address (every interface included) is refused at startup,
// unless --debug-allow-remote accepts it.
func TestDebugAddrLoopbackOnly(t *testing.T) {
	// A cancelled context: had it started, it would stop at once.
	ctx, cancel := context.WithCancel(t.Context())
	cancel()
	for _, addr := range []string{":0", "0.0.0.0:0", "[::]:0", "192.0.2.1:0"} {
		err := run(ctx, []string{"--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1", "--port", "0",
			"--debug-addr", addr}, noEnv, io.Discard, io.Discard)
		require.ErrorIs(t, err, errUsage, addr)
		assert.Contains(t, err.Error(), "is not a loopback address", addr)
	}
	for _, addr := range []string{"127.0.0.1:0", "localhost:0"} {
		p := startInProcess(t, nil, "--debug-addr", addr)
		assert.Regexp(t, debugReady, p.stdout.String(), addr)
	}
	p := startInProcess(t, nil, "--debug-addr", ":0", "--debug-allow-remote")
	assert.Regexp(t, debugReady, p.stdout.String())
	assert.Contains(t, p.stderr.String(), "--debug-addr listens on a non-loopback address")
}

func TestDebugAddrOffByDefault(t *testing.T) {
	p := startInProcess(t, nil)
	assert.NotRegexp(t, debugReady, p.stdout.String())
}

func TestDebugAddrBad(t *testing.T) {
	err := run(t.Context(), []string{"--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1", "--port", "0",
		"--debug-addr", "127.0.0.1:notaport"}, noEnv, io.Discard, io.Discard)
	require.ErrorIs(t, err, errUsage)
	assert.Contains(t, err.Error(), "--debug-addr")
}
