package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// inproc is the proxy's run in this process, by default with engines that
// refuse connections: enough for everything the proxy answers itself.
type inproc struct {
	url, addr      string
	stdout, stderr *syncBuffer
	client         *http.Client
}

// startInProcess runs the proxy with args on 127.0.0.1 and stops it when
// the test ends.
func startInProcess(t *testing.T, getenv func(string) string, args ...string) *inproc {
	t.Helper()
	if getenv == nil {
		getenv = noEnv
	}
	base := []string{"--host", "127.0.0.1", "--port", "0", "--health-interval", "1h"}
	if !slices.Contains(args, "--prefill") {
		base = append(base, "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1")
	}
	return runInProcess(t, append(base, args...), getenv, proxyReady, "proxy")
}

// runInProcess runs the command line args in this process, waits for the
// ready line (its first group: the URL) and stops it when the test ends;
// what names it in failures.
func runInProcess(t *testing.T, args []string, getenv func(string) string, ready *regexp.Regexp, what string) *inproc {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, getenv, stdout, stderr) }()
	p := &inproc{stdout: stdout, stderr: stderr, client: &http.Client{Transport: &http.Transport{}}}
	t.Cleanup(func() {
		p.client.CloseIdleConnections()
		cancel()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			t.Errorf("the %s did not stop", what)
		}
		if t.Failed() {
			t.Logf("%s stderr:\n%s", what, stderr.String())
		}
	})
	for range 1000 {
		if m := ready.FindStringSubmatch(stdout.String()); m != nil {
			p.url = m[1]
			p.addr = strings.TrimPrefix(p.url, "http://")
			return p
		}
		select {
		case err := <-done:
			done <- err // for the cleanup
			require.FailNow(t, "the "+what+" stopped", "%v\n%s", err, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	require.FailNow(t, "the "+what+" did not print its ready line")
	return nil
}

// do sends one request and returns the status, headers and body.
func (p *inproc) do(t *testing.T, method, path, body string, header ...string) (int, http.Header, string) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var r io.Reader
	if body != "" {
		r = strings.NewReader(body)
	}
	req, err := http.NewRequestWithContext(ctx, method, p.url+path, r)
	require.NoError(t, err)
	for i := 0; i+1 < len(header); i += 2 {
		req.Header.Set(header[i], header[i+1])
	}
	resp, err := p.client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, resp.Header, string(b)
}

// metric returns the value of one sample of the proxy's /metrics page.
func (p *inproc) metric(t *testing.T, sample string) string {
	t.Helper()
	_, _, page := p.do(t, http.MethodGet, "/metrics", "")
	return metricValue(page, sample)
}

// dial opens a raw connection to the proxy with a deadline for the test.
func (p *inproc) dial(t *testing.T) net.Conn {
	t.Helper()
	c, err := net.DialTimeout("tcp", p.addr, 5*time.Second)
	require.NoError(t, err)
	require.NoError(t, c.SetDeadline(time.Now().Add(10*time.Second)))
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// rawResponse reads one response from a raw connection.
func rawResponse(t *testing.T, r *bufio.Reader) (*http.Response, string) {
	t.Helper()
	resp, err := http.ReadResponse(r, nil)
	require.NoError(t, err)
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	_ = resp.Body.Close()
	return resp, string(b)
}

// openAIError matches OpenAI's error shape with the proxy's prefix.
var openAIError = regexp.MustCompile(`^\{"error":\{"code":"[a-z_]+","message":"proxy: [^"]*","param":null,"type":"(invalid_request_error|server_error|authentication_error)"\}\}$`)

func assertJSONError(t *testing.T, status int, h http.Header, body string, wantStatus int, wantCode string) {
	t.Helper()
	assert.Equal(t, wantStatus, status, body)
	assert.Equal(t, "application/json", h.Get("Content-Type"))
	assert.Regexp(t, openAIError, body)
	assert.Contains(t, body, fmt.Sprintf(`"code":%q`, wantCode))
}
