package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The attacks of issue 21 (items 12, 13, 15, 17, 19), each against the
// proxy in this process with simulated engines: while the attack runs, a
// well-behaved client keeps being served, with the single engine's answer.

// goodChat is a well-behaved client's request.
const goodChat = `{"model":"sim-model","messages":[{"role":"user","content":"are you there?"}],"max_tokens":8}`

// served sends goodChat and reports whether it got 200 with the single
// engine's answer; the status and body otherwise.
func served(t *testing.T, p *inproc) (bool, string) {
	t.Helper()
	status, _, body := p.do(t, http.MethodPost, "/v1/chat/completions", goodChat)
	if status != http.StatusOK {
		return false, strconv.Itoa(status) + " " + body
	}
	var resp struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &resp), body)
	require.Len(t, resp.Choices, 1)
	assert.Equal(t, reference(t, []byte(goodChat)), resp.Choices[0].Message.Content)
	return true, ""
}

// assertServed checks that n requests in a row are served.
func assertServed(t *testing.T, p *inproc, n int) {
	t.Helper()
	for i := range n {
		ok, got := served(t, p)
		require.True(t, ok, "request %d of a well-behaved client during the attack: %s", i, got)
	}
}

// waitMetric polls a sample of /metrics until ok accepts its value.
func waitMetric(t *testing.T, p *inproc, sample string, ok func(v int) bool) {
	t.Helper()
	v := ""
	for range 1000 {
		v = p.metric(t, sample)
		if f, err := strconv.ParseFloat(v, 64); err == nil && ok(int(f)) {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	require.FailNow(t, "metric never reached the expected value", "%s = %s", sample, v)
}

// dialFrom opens a raw connection to the proxy from the loopback address
// local (127.0.0.0/8 is all loopback on Linux); the test is skipped where
// that address cannot be bound.
func dialFrom(t *testing.T, p *inproc, local string) net.Conn {
	t.Helper()
	d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(local)}}
	c, err := d.Dial("tcp", p.addr)
	if err != nil {
		t.Skipf("cannot dial from %s: %v", local, err)
	}
	require.NoError(t, c.SetDeadline(time.Now().Add(20*time.Second)))
	t.Cleanup(func() { _ = c.Close() })
	return c
}

// trickle sends a completion request's headers, declaring length bytes,
// and the first sent bytes of its body.
func trickle(t *testing.T, c net.Conn, path string, length, sent int) {
	t.Helper()
	_, err := fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s",
		path, length, strings.Repeat(" ", sent))
	require.NoError(t, err)
}

// Item 12: bodies that trickle in hold no turn slot. Four times
// --max-concurrent-turns connections send a few bytes of their bodies and
// stop; a client whose body is in is still served, again and again.
func TestSlowBodiesHoldNoTurnSlot(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(), "--max-concurrent-turns", "4")
	const attackers, sent = 16, 3
	for range attackers {
		trickle(t, p.dial(t), "/v1/chat/completions", 1000, sent)
	}
	// Every attacker's bytes are in the proxy.
	waitMetric(t, p, "bidikv_buffered_request_bytes", func(v int) bool { return v >= attackers*sent })
	assertServed(t, p, 8)
	assert.Equal(t, strconv.Itoa(attackers), p.metric(t, "bidikv_request_bodies_in_transit"))
	assert.Equal(t, strconv.Itoa(attackers*sent), p.metric(t, "bidikv_buffered_request_bytes"))
	assert.Equal(t, "0", p.metric(t, "bidikv_inflight_turns"))
}

// Item 12, the bounds of bodies in transit: one client address holds at
// most --max-client-bodies-in-transit of them (the rest are shed at once
// with 503 and Retry-After) while other addresses are served; and all
// addresses together at most --max-bodies-in-transit.
func TestBodiesInTransitBounded(t *testing.T) {
	t.Run("per client address", func(t *testing.T) {
		cl := kvroutetest.NewCluster(t, 1, 1)
		p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(),
			"--max-concurrent-turns", "2", "--max-client-bodies-in-transit", "4")
		shed := 0
		for i := range 12 {
			c := dialFrom(t, p, "127.0.0.2")
			trickle(t, c, "/v1/chat/completions", 1000, 3)
			if i < 4 {
				waitMetric(t, p, "bidikv_request_bodies_in_transit", func(v int) bool { return v == i+1 })
				continue
			}
			resp, body := rawResponse(t, bufio.NewReader(c))
			assertJSONError(t, resp.StatusCode, resp.Header, body, http.StatusServiceUnavailable, "overloaded")
			assert.Equal(t, "1", resp.Header.Get("Retry-After"))
			assert.Contains(t, body, "--max-client-bodies-in-transit")
			shed++
		}
		assert.Equal(t, 8, shed)
		assertServed(t, p, 4) // from 127.0.0.1
		assert.Equal(t, "8", p.metric(t, `bidikv_rejected_requests_total{reason="overloaded_client_bodies",status="503"}`))
	})
	t.Run("all addresses", func(t *testing.T) {
		cl := kvroutetest.NewCluster(t, 1, 1)
		p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(),
			"--max-bodies-in-transit", "3", "--max-client-bodies-in-transit", "0")
		held := make([]net.Conn, 3)
		for i := range held {
			held[i] = p.dial(t)
			trickle(t, held[i], "/v1/chat/completions", 1000, 3)
		}
		waitMetric(t, p, "bidikv_request_bodies_in_transit", func(v int) bool { return v == 3 })
		status, h, body := p.do(t, http.MethodPost, "/v1/chat/completions", goodChat)
		assertJSONError(t, status, h, body, http.StatusServiceUnavailable, "overloaded")
		assert.Contains(t, body, "--max-bodies-in-transit")
		// Once one ends, bodies are received again.
		require.NoError(t, held[0].Close())
		waitMetric(t, p, "bidikv_request_bodies_in_transit", func(v int) bool { return v == 2 })
		assertServed(t, p, 2)
	})
}

// Item 13: a declared Content-Length reserves nothing. Eight connections
// declaring the largest body each (8 x 32 MiB, the whole default budget)
// and sending one byte hold eight bytes of the budget, not 256 MiB, and
// the router's buffers grow with what arrived, not with what was declared:
// other clients are served, and the heap stays far below the declared sum.
func TestDeclaredLengthChargedAsItArrives(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL())
	const attackers, declared = 8, 32 << 20
	before := heapInUse()
	for range attackers {
		trickle(t, p.dial(t), "/v1/chat/completions", declared, 1)
	}
	waitMetric(t, p, "bidikv_buffered_request_bytes", func(v int) bool { return v >= attackers })
	assertServed(t, p, 4)
	assert.Equal(t, strconv.Itoa(attackers), p.metric(t, "bidikv_buffered_request_bytes"))
	grown := heapInUse() - before
	assert.Less(t, grown, int64(attackers*declared/4), "heap grown by %d MiB", grown>>20)
}

// heapInUse returns the bytes of live heap objects after a collection.
func heapInUse() int64 {
	runtime.GC()
	var m runtime.MemStats
	runtime.ReadMemStats(&m)
	return int64(m.HeapAlloc)
}

// Item 15: connections are bounded by --max-connections. Connections that
// wait for a request (idle keep-alive ones, or new ones that sent
// nothing) make room for new clients once they have waited a second: the
// one that waited longest is closed. When every connection is serving a
// request, a new one gets 503 with Retry-After on the raw connection, in
// the error shape of its request line's API, and is closed.
func TestConnectionCap(t *testing.T) {
	t.Run("idle connections make room", func(t *testing.T) {
		cl := kvroutetest.NewCluster(t, 1, 1)
		p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(), "--max-connections", "8")
		idle := make([]*bufio.Reader, 8)
		for i := range idle {
			c := p.dial(t)
			_, err := fmt.Fprintf(c, "GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n")
			require.NoError(t, err)
			idle[i] = bufio.NewReader(c)
			resp, _ := rawResponse(t, idle[i])
			require.Equal(t, http.StatusOK, resp.StatusCode)
		}
		// The eight wait for their next request; the client gets in once
		// the first of them has waited long enough.
		ok, got := false, ""
		for range 200 {
			if ok, got = served(t, p); ok {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		require.True(t, ok, "a new client was never served: %s", got)
		assertServed(t, p, 4)
		page := p.metric(t, "bidikv_evicted_connections_total")
		assert.NotEqual(t, "0", page)
		n, _ := strconv.Atoi(p.metric(t, "bidikv_client_connections"))
		assert.LessOrEqual(t, n, 8)
		// The first idle connection, the one that waited longest, was closed.
		_, err := idle[0].ReadByte()
		assert.Error(t, err, "closed")
	})
	t.Run("busy connections refuse", func(t *testing.T) {
		// Four connections that send their request, and so are not
		// waiting for one (they wait for a second after connecting too).
		p := startInProcess(t, nil, "--max-connections", "4")
		busy := make([]net.Conn, 4)
		for i := range busy {
			busy[i] = p.dial(t)
			trickle(t, busy[i], "/v1/chat/completions", 1000, 1)
		}
		for _, path := range []string{"/v1/chat/completions", "/v1/messages", ""} {
			c := p.dial(t)
			if path != "" {
				_, err := fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Length: 2\r\n\r\n{}", path)
				require.NoError(t, err)
			}
			resp, body := rawResponse(t, bufio.NewReader(c))
			assert.Equal(t, "1", resp.Header.Get("Retry-After"))
			assert.True(t, resp.Close, "Connection: close")
			if path == "/v1/messages" {
				assertAnthropicError(t, resp.StatusCode, resp.Header, body, http.StatusServiceUnavailable, "overloaded_error")
			} else {
				assertJSONError(t, resp.StatusCode, resp.Header, body, http.StatusServiceUnavailable, "overloaded")
			}
			assert.Contains(t, body, "--max-connections")
			waitClosed(t, c, 5*time.Second)
		}
		for _, c := range busy {
			require.NoError(t, c.Close())
		}
		// The closes may not have reached the proxy yet: a /metrics request
		// refused at the cap is one refusal more, counted here.
		own := 0
		for range 200 {
			status, _, page := p.do(t, http.MethodGet, "/metrics", "")
			if status == http.StatusServiceUnavailable {
				own++
				time.Sleep(10 * time.Millisecond)
				continue
			}
			require.Equal(t, http.StatusOK, status)
			assert.Equal(t, strconv.Itoa(3+own), metricValue(page, "bidikv_refused_connections_total"), "three refusals, and %d of /metrics", own)
			return
		}
		require.FailNow(t, "/metrics was refused 200 times after the busy connections closed")
	})
}

// slowStreamEngine is a decode engine whose streams never end: one chat
// chunk of about 1 KiB every interval until the request is cancelled, as
// a real engine's tokens trickle. It reports each stream's end on ended.
func slowStreamEngine(t *testing.T, interval time.Duration) (url string, ended <-chan int) {
	t.Helper()
	done := make(chan int, 16)
	chunk := []byte(`data: {"id":"cmpl-slow","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[{"index":0,"delta":{"content":"` +
		strings.Repeat("x", 1000) + `"},"finish_reason":null}]}` + "\n\n")
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path != "/v1/chat/completions" {
			return // /health
		}
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		tick := time.NewTicker(interval)
		defer tick.Stop()
		n := 0
		defer func() { done <- n }()
		for {
			if _, err := w.Write(chunk); err != nil {
				return
			}
			_ = http.NewResponseController(w).Flush()
			n++
			select {
			case <-r.Context().Done():
				return
			case <-tick.C:
			}
		}
	}))
	t.Cleanup(srv.Close)
	return srv.URL, done
}

// Item 19: a client that stops reading a slow stream is cut after
// --client-write-timeout although every write still lands in the kernel's
// buffers: the bytes it leaves unacknowledged count, not only writes that
// block. Its turn is freed while the engine still streams, and the
// connection closed.
func TestNonReadingClientCut(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("unacknowledged bytes are read from the socket on Linux only")
	}
	cl := kvroutetest.NewCluster(t, 1, 1)
	d, ended := slowStreamEngine(t, 10*time.Millisecond) // about 100 KB/s
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", d, "--client-write-timeout", "300ms")

	// A small receive window, and no reads at all.
	dl := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	c, err := dl.Dial("tcp", p.addr)
	require.NoError(t, err)
	t.Cleanup(func() { _ = c.Close() })
	body := `{"model":"sim-model","messages":[{"role":"user","content":"go on"}],"stream":true}`
	_, err = fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
	require.NoError(t, err)

	waitMetric(t, p, "bidikv_inflight_turns", func(v int) bool { return v == 1 })
	select {
	case n := <-ended:
		t.Logf("the engine's stream was cancelled after %d chunks (%d KiB)", n, n)
	case <-time.After(10 * time.Second):
		require.FailNow(t, "the turn of a client that reads nothing still streams after 10 s")
	}
	waitMetric(t, p, "bidikv_inflight_turns", func(v int) bool { return v == 0 })
	assert.Equal(t, "1", p.metric(t, "bidikv_stalled_clients_total"))
}

// silentEngine is a decode engine that accepts completion requests and
// never answers them: no headers at all, or (headersOnly) a stream's
// headers and then nothing. It counts the requests it got. Other routes
// (the proxy's capability probe: /version, /metrics, render, /tokenize)
// answer 404 at once.
func silentEngine(t *testing.T, headersOnly bool) (string, *atomic.Int32) {
	t.Helper()
	var n atomic.Int32
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			if r.URL.Path != "/health" {
				http.NotFound(w, r)
			}
			return // /health answers
		}
		if r.URL.Path != "/v1/chat/completions" {
			http.NotFound(w, r)
			return
		}
		n.Add(1)
		if headersOnly {
			w.Header().Set("Content-Type", "text/event-stream")
			_ = http.NewResponseController(w).Flush()
		}
		select {
		case <-r.Context().Done():
		case <-release:
		}
	}))
	t.Cleanup(func() { close(release); srv.Close() })
	return srv.URL, &n
}

// Item 17: a decode engine that never answers costs a turn one first-byte
// (or first-event) timeout and one prefill, not three of each: the turn is
// redone only for another decode engine that may answer, and only once.
func TestSilentDecodeEngineBounded(t *testing.T) {
	for _, tc := range []struct {
		name        string
		silent      int  // silent decode engines
		good        bool // and one that answers
		headersOnly bool
		maxPrefills int
		wantOK      bool
	}{
		{name: "one silent engine", silent: 1, maxPrefills: 1},
		{name: "one silent engine after its headers", silent: 1, headersOnly: true, maxPrefills: 1},
		{name: "two silent engines", silent: 2, maxPrefills: 2},
		{name: "three silent engines", silent: 3, maxPrefills: 2},
		{name: "a silent engine and one that answers", silent: 1, good: true, maxPrefills: 2, wantOK: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 1, 1)
			var decode []string
			var legs []*atomic.Int32
			for range tc.silent {
				u, n := silentEngine(t, tc.headersOnly)
				decode, legs = append(decode, u), append(legs, n)
			}
			if tc.good {
				decode = append(decode, cl.Decode[0].URL())
			}
			p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", strings.Join(decode, ","),
				"--first-byte-timeout", "200ms", "--idle-timeout", "200ms")
			body := `{"model":"sim-model","messages":[{"role":"user","content":"hello"}],"max_tokens":8,"stream":true}`
			status, h, got := p.do(t, http.MethodPost, "/v1/chat/completions", body)
			prefills := 0
			for _, r := range cl.Prefill[0].Requests() {
				if r.Role == "prefill" {
					prefills++
				}
			}
			silentLegs := 0
			for _, n := range legs {
				assert.LessOrEqual(t, n.Load(), int32(1), "a silent engine got a second leg")
				silentLegs += int(n.Load())
			}
			assert.LessOrEqual(t, prefills, tc.maxPrefills, "prefills")
			assert.LessOrEqual(t, silentLegs, 2, "legs sent to silent engines")
			if tc.wantOK {
				require.Equal(t, http.StatusOK, status, got)
				assert.Contains(t, got, "data: [DONE]")
				return
			}
			assert.Equal(t, http.StatusGatewayTimeout, status, got)
			assert.Equal(t, "application/json", h.Get("Content-Type"))
			assert.Contains(t, got, `"code":"decode_timeout"`)
		})
	}
}

// Item 14: the memory a body takes is bounded by its size, not by how many
// members it has. An 18 MB body of one-character members (3.6 million,
// duplicates of one key) is refused with 400, on every API in its error
// shape, having allocated less than four times its size (a bound on the
// heap it took); before, its member index and leg pieces allocated 2.3 GB.
func TestManyMembersBodyBounded(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL())
	const size = 18 << 20
	for _, path := range []string{"/v1/chat/completions", "/v1/messages"} {
		t.Run(path, func(t *testing.T) {
			var b strings.Builder
			b.Grow(size + 100)
			b.WriteString(`{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"hi"}]`)
			for b.Len() < size {
				b.WriteString(`,"a":0`)
			}
			b.WriteString("}")
			body := b.String()
			var before, after runtime.MemStats
			runtime.ReadMemStats(&before)
			status, h, got := p.do(t, http.MethodPost, path, body)
			runtime.ReadMemStats(&after)
			assert.Equal(t, http.StatusBadRequest, status, got)
			assert.Equal(t, "application/json", h.Get("Content-Type"))
			assert.Contains(t, got, "more than 10000 members")
			if path == "/v1/messages" {
				assert.Contains(t, got, `"type":"invalid_request_error"`)
			}
			allocated := after.TotalAlloc - before.TotalAlloc
			t.Logf("allocated %d MiB for a %d MiB body", allocated>>20, len(body)>>20)
			assert.Less(t, allocated, uint64(4*len(body)))
		})
	}
}
