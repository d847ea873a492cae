package main

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// waitClosed reads from c until the peer closes it, bounded by within.
func waitClosed(t *testing.T, c net.Conn, within time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	require.NoError(t, c.SetReadDeadline(start.Add(within)))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		require.FailNow(t, "the connection is still open", "after %v", within)
	}
	return time.Since(start)
}

// An idle keep-alive connection is closed after --idle-conn-timeout.
func TestIdleConnectionClosed(t *testing.T) {
	p := startInProcess(t, nil, "--idle-conn-timeout", "200ms")
	c := p.dial(t)
	_, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
	require.NoError(t, err)
	r := bufio.NewReader(c)
	resp, _ := rawResponse(t, r)
	require.Equal(t, http.StatusOK, resp.StatusCode)
	took := waitClosed(t, c, 5*time.Second)
	assert.GreaterOrEqual(t, took, 150*time.Millisecond, "not before the timeout")
}

// A request body that trickles in is cut at --read-body-timeout with 408
// in OpenAI's error shape, and its connection closed.
func TestSlowBodyCut(t *testing.T) {
	p := startInProcess(t, nil, "--read-body-timeout", "300ms")
	c := p.dial(t)
	_, err := io.WriteString(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
	require.NoError(t, err)
	start := time.Now()
	resp, body := rawResponse(t, bufio.NewReader(c))
	assertJSONError(t, resp.StatusCode, resp.Header, body, http.StatusRequestTimeout, "request_timeout")
	assert.Less(t, time.Since(start), 5*time.Second)
	waitClosed(t, c, 5*time.Second)

	_, _, page := p.do(t, http.MethodGet, "/metrics", "")
	assert.Equal(t, "1", metricValue(page, `bidikv_rejected_requests_total{reason="body_timeout",status="408"}`))
	assert.Equal(t, "0", metricValue(page, `bidikv_inflight_turns`))
	assert.Equal(t, "0", metricValue(page, `bidikv_buffered_request_bytes`))
}

// slowBody starts a completion request of contentLength bytes and sends
// only sent of them, so that it stays in transit, holding sent bytes of the
// budget, until the test closes the connection.
func slowBody(t *testing.T, p *inproc, contentLength, sent int) net.Conn {
	t.Helper()
	c := p.dial(t)
	_, err := fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Length: %d\r\n\r\n%s", contentLength, strings.Repeat(" ", sent))
	require.NoError(t, err)
	// In transit once the buffered-bytes gauge shows its bytes.
	for range 500 {
		if v, _ := strconv.Atoi(p.metric(t, "bidikv_buffered_request_bytes")); v >= sent {
			return c
		}
		time.Sleep(5 * time.Millisecond)
	}
	require.FailNow(t, "the slow body's bytes were not charged")
	return nil
}

// hangingEngine is an engine that accepts every request and answers none
// until the request is cancelled or the test ends.
func hangingEngine(t *testing.T) string {
	t.Helper()
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(func() { close(release); srv.Close() })
	return srv.URL
}

// heldTurn sends a complete completion request that the proxy admits as a
// turn and that then waits on its (hanging) engines until the test closes
// the connection.
func heldTurn(t *testing.T, p *inproc, path string) net.Conn {
	t.Helper()
	before, _ := strconv.Atoi(p.metric(t, "bidikv_inflight_turns"))
	c := p.dial(t)
	body := `{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":1}`
	if path == kvroute.PathMessages {
		body = `{"model":"m","max_tokens":1,"messages":[{"role":"user","content":"hi"}]}`
	}
	_, err := fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
	require.NoError(t, err)
	for range 500 {
		if n, _ := strconv.Atoi(p.metric(t, "bidikv_inflight_turns")); n > before {
			return c
		}
		time.Sleep(5 * time.Millisecond)
	}
	require.FailNow(t, "the held turn was not admitted")
	return nil
}

// Above --max-concurrent-turns and --max-buffered-bytes, requests are shed
// at once with 503, Retry-After and OpenAI's error shape, while the
// admitted turns go on; once they end, requests are admitted again.
func TestShedding(t *testing.T) {
	chat := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	t.Run("concurrent turns", func(t *testing.T) {
		e := hangingEngine(t)
		p := startInProcess(t, nil, "--max-concurrent-turns", "1", "--prefill", e, "--decode", e)
		held := heldTurn(t, p, kvroute.PathChatCompletions)
		status, h, body := p.do(t, http.MethodPost, "/v1/chat/completions", chat)
		assertJSONError(t, status, h, body, http.StatusServiceUnavailable, "overloaded")
		assert.Equal(t, "1", h.Get("Retry-After"))
		assert.Contains(t, body, "--max-concurrent-turns")
		status, _, _ = p.do(t, http.MethodGet, "/health", "")
		assert.Equal(t, http.StatusOK, status, "other routes are not shed")
		_, _, page := p.do(t, http.MethodGet, "/metrics", "")
		assert.Equal(t, "1", metricValue(page, `bidikv_rejected_requests_total{reason="overloaded_turns",status="503"}`))

		require.NoError(t, held.Close())
		admitted := false
		for range 500 {
			if status, _, _ := p.do(t, http.MethodPost, "/v1/chat/completions", "{"); status == http.StatusBadRequest {
				admitted = true
				break
			}
			time.Sleep(5 * time.Millisecond)
		}
		assert.True(t, admitted, "admitted again once the held turn ended")
	})
	t.Run("buffered bytes", func(t *testing.T) {
		p := startInProcess(t, nil, "--max-body-bytes", "4096", "--max-buffered-bytes", "6000")
		held := slowBody(t, p, 4000, 3999)
		_, _, page := p.do(t, http.MethodGet, "/metrics", "")
		assert.Equal(t, "3999", metricValue(page, "bidikv_buffered_request_bytes"), "the bytes that arrived, not the declared length")

		big := `{"model":"m","messages":[{"role":"user","content":"` + strings.Repeat("x", 2500) + `"}]}`
		status, h, body := p.do(t, http.MethodPost, "/v1/chat/completions", big)
		assertJSONError(t, status, h, body, http.StatusServiceUnavailable, "overloaded")
		assert.Equal(t, "1", h.Get("Retry-After"))

		// A chunked body of the same size is shed as its bytes arrive.
		req, err := http.NewRequest(http.MethodPost, p.url+"/v1/chat/completions", io.MultiReader(strings.NewReader(big)))
		require.NoError(t, err)
		req.ContentLength = -1
		resp, err := p.client.Do(req)
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		assertJSONError(t, resp.StatusCode, resp.Header, string(b), http.StatusServiceUnavailable, "overloaded")
		assert.Equal(t, "1", resp.Header.Get("Retry-After"))

		status, _, body = p.do(t, http.MethodPost, "/v1/chat/completions", chat)
		assert.Equal(t, http.StatusBadGateway, status, "a small body fits and reaches the (absent) engines: %s", body)

		require.NoError(t, held.Close())
		_, _, page = p.do(t, http.MethodGet, "/metrics", "")
		assert.Equal(t, "2", metricValue(page, `bidikv_rejected_requests_total{reason="overloaded_bytes",status="503"}`))
	})
	t.Run("body above the limit", func(t *testing.T) {
		p := startInProcess(t, nil, "--max-body-bytes", "1024")
		status, h, body := p.do(t, http.MethodPost, "/v1/chat/completions", strings.Repeat("x", 2048))
		assert.Equal(t, http.StatusRequestEntityTooLarge, status, body)
		assert.Equal(t, "application/json", h.Get("Content-Type"))
		_, _, page := p.do(t, http.MethodGet, "/metrics", "")
		assert.Equal(t, "1", metricValue(page, `bidikv_rejected_requests_total{reason="too_large",status="413"}`))
		assert.Equal(t, "absent", metricValue(page, `bidikv_turns_total{path="/v1/chat/completions",result="error",reuse="miss"}`))
	})
}

// A client that stops reading a stream is cut after --client-write-timeout
// and its turn freed, instead of holding a slot for ever.
func TestStalledReaderFreed(t *testing.T) {
	t.Parallel() // slow: real processes or a long stream
	cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithNumBlocks(1<<14))
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(), "--client-write-timeout", "300ms")

	// A small receive window, so the proxy's writes block soon.
	d := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	c, err := d.Dial("tcp", p.addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	body := `{"model":"sim-model","messages":[{"role":"user","content":"go on for ever"}],"stream":true,"max_tokens":100000,"ignore_eos":true}`
	_, err = fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	require.NoError(t, err)

	started, freed := false, false
	for range 1500 { // 15 s
		_, _, page := p.do(t, http.MethodGet, "/metrics", "")
		n := metricValue(page, "bidikv_inflight_turns")
		started = started || n == "1"
		if started && n == "0" {
			freed = true
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	require.True(t, started, "the turn started")
	assert.True(t, freed, "the stalled turn was freed")
}

// A trickling body on a route that does not read it (here a 405) is cut
// at --read-body-timeout too: net/http would wait for it to discard it.
func TestSlowBodyOnOtherRoutesCut(t *testing.T) {
	p := startInProcess(t, nil, "--read-body-timeout", "300ms")
	c := p.dial(t)
	_, err := io.WriteString(c, "POST /health HTTP/1.1\r\nHost: proxy\r\nContent-Length: 100\r\n\r\n{")
	require.NoError(t, err)
	resp, body := rawResponse(t, bufio.NewReader(c))
	assertJSONError(t, resp.StatusCode, resp.Header, body, http.StatusMethodNotAllowed, "method_not_allowed")
	waitClosed(t, c, 5*time.Second)
}
