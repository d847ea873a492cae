package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The soak's limits: small, so that one short run reaches every one of them.
const (
	soakIdleConn     = 600 * time.Millisecond // --idle-conn-timeout
	soakReadBody     = 700 * time.Millisecond // --read-body-timeout
	soakReadHeader   = 900 * time.Millisecond // --read-header-timeout
	soakSlack        = 1500 * time.Millisecond
	soakEarly        = 150 * time.Millisecond // a close this much before its deadline is premature
	soakMaxTurns     = 4                      // --max-concurrent-turns
	soakMaxBody      = 128 << 10              // --max-body-bytes
	soakMaxBuffered  = 2 * soakMaxBody        // --max-buffered-bytes: two large bodies at once
	soakITL          = 40 * time.Millisecond  // the decode engine's inter-token latency
	soakStreamTokens = 25                     // about 1 s per slow stream, longer than --read-body-timeout
	soakMaxRounds    = 8
	soakMinRounds    = 2
	soakRoundBudget  = 30 * time.Second // no round starts after this
	soakModeHeader   = "X-Soak-Mode"    // forwarded to both legs: picks the engine behind each dispatcher
	soakLengthOnly   = "lengthonly"     // prefill by the older engine
)

// soakNeedles must never reach a client: a handle's key and its members.
var soakNeedles = []string{"kv_transfer_params", "remote_block_ids", "remote_engine_id"}

// TestSoak runs one in-process proxy, with small limits, against simulated
// engines behind two dispatchers (real engines, an older prefill engine and
// malformed fake decode engines, chosen per request by X-Soak-Mode), for
// several rounds of: connections held idle or trickling (closed at their
// deadlines), malformed decode answers (no handle byte reaches a client) and
// a stop on P's first token against an older prefill engine, then slow
// streams with shedding above --max-concurrent-turns, then a burst of large
// bodies against --max-buffered-bytes. Every byte every client receives is
// scanned for handle bytes.
func TestSoak(t *testing.T) {
	if testing.Short() {
		t.Skip("soak: skipped with -short")
	}
	began := time.Now()
	s := newSoak(t)
	var rounds []soakRound
	for r := range soakMaxRounds {
		if r >= soakMinRounds && time.Since(began) > soakRoundBudget {
			break
		}
		rs := soakRound{n: r}
		start := time.Now()
		s.phaseA(t, &rs) // parts 1, 4, 5 at once
		s.phaseShed(t, &rs)
		s.phaseBurst(t, &rs)
		s.settle(t)
		rs.retained = metricValue(s.metrics(t), "bidikv_retained_handles")
		runtime.GC()
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		rs.heap, rs.goroutines, rs.took = ms.HeapAlloc, runtime.NumGoroutine(), time.Since(start)
		rounds = append(rounds, rs)
		t.Logf("round %d: %s", r, rs.String())
		if t.Failed() {
			break
		}
	}

	// The counters agree with what the clients saw.
	page := s.metrics(t)
	var shedTurns, shedBytes, bodyTimeouts int
	for _, rs := range rounds {
		shedTurns += rs.shedTurns + rs.burstShedTurns
		shedBytes += rs.burstShed
		bodyTimeouts += rs.slowBodyTurns
	}
	assert.Equal(t, strconv.Itoa(shedTurns), metricValue(page, `bidikv_rejected_requests_total{reason="overloaded_turns",status="503"}`))
	assert.Equal(t, strconv.Itoa(shedBytes), metricValue(page, `bidikv_rejected_requests_total{reason="overloaded_bytes",status="503"}`))
	assert.Equal(t, strconv.Itoa(bodyTimeouts), metricValue(page, `bidikv_rejected_requests_total{reason="body_timeout",status="408"}`))
	assert.Equal(t, "0", metricValue(page, "bidikv_inflight_turns"))
	assert.Equal(t, "0", metricValue(page, "bidikv_buffered_request_bytes"))

	// No handle byte reached any client, over every connection of the run.
	n, conns, hits := s.wire.totals()
	for _, nd := range soakNeedles {
		assert.Zero(t, hits[nd], "%q reached a client", nd)
	}
	if len(rounds) > 1 {
		first, last := rounds[0], rounds[len(rounds)-1]
		assert.Less(t, last.goroutines, first.goroutines+100, "goroutines grow from round to round")
	}
	t.Logf("soak: %d rounds in %v; clients received %d bytes over %d connections, handle bytes: %v; fake decode legs by mode: %v",
		len(rounds), time.Since(began).Round(time.Millisecond), n, conns, hits, s.fake.counts())
}

// TestSoakKnownHandleLeaks sends the malformed decode answers of
// soakLeakModes through the proxy: none may reach the client with handle
// bytes (each did before sse.Capture dropped handle members from other
// lines and failed nested handles closed).
func TestSoakKnownHandleLeaks(t *testing.T) {
	if testing.Short() {
		t.Skip("soak")
	}
	s := newSoak(t)
	s.malformedModes(t, soakLeakModes)
	_, _, hits := s.wire.totals()
	for _, nd := range soakNeedles {
		assert.Zero(t, hits[nd], "%q reached a client", nd)
	}
}

// soakRound collects what one round measured.
type soakRound struct {
	n int
	// part 1
	idleClose, slowBodyClose, slowHealthClose, slowHeaderClose []time.Duration
	slowBodyTurns                                              int // 408s on the completion route
	controlRequests                                            int
	// part 4
	modes int
	// part 5
	stopFirst int
	// part 3
	admitted, shedTurns int
	shedMax             time.Duration
	streamMax           time.Duration
	// part 2
	burstAdmitted, burstShed, burstShedTurns, burstSamples int
	maxBuffered, maxInflight                               int64
	// soak
	heap       uint64
	goroutines int
	retained   string // bidikv_retained_handles
	took       time.Duration
}

func (r soakRound) String() string {
	return fmt.Sprintf("took %v; idle closes %v; slow-body closes (408) %v; slow-body /health closes %v; slow-header closes %v; control requests on one connection %d; "+
		"malformed modes %d; stop-on-first-token turns %d; slow streams admitted %d (longest %v), shed %d (slowest 503 %v); "+
		"burst admitted %d, shed %d for bytes and %d for turns, gauge samples %d, max buffered %d of %d, max inflight %d; retained handles %s, heap %d KiB, goroutines %d",
		r.took.Round(time.Millisecond), rounded(r.idleClose), rounded(r.slowBodyClose), rounded(r.slowHealthClose), rounded(r.slowHeaderClose), r.controlRequests,
		r.modes, r.stopFirst, r.admitted, r.streamMax.Round(time.Millisecond), r.shedTurns, r.shedMax.Round(time.Millisecond),
		r.burstAdmitted, r.burstShed, r.burstShedTurns, r.burstSamples, r.maxBuffered, soakMaxBuffered, r.maxInflight, r.retained, r.heap>>10, r.goroutines)
}

func rounded(ds []time.Duration) string {
	if len(ds) == 0 {
		return "[]"
	}
	lo, hi := ds[0], ds[0]
	for _, d := range ds {
		lo, hi = min(lo, d), max(hi, d)
	}
	return fmt.Sprintf("%d in %v..%v", len(ds), lo.Round(time.Millisecond), hi.Round(time.Millisecond))
}

// soak is the rig: engines, dispatchers, the proxy and a recording client.
type soak struct {
	proxy  *inproc
	wire   *soakWire
	client *http.Client
	fake   *fakeDecode
	decURL string // the decode dispatcher, as errors name it
	pOld   string // the older prefill engine, for part 5's control; "" once checked
	mu     sync.Mutex
	seq    int
}

func newSoak(t *testing.T) *soak {
	t.Helper()
	reg := kvroutetest.NewRegistry()
	common := []kvroutetest.Option{kvroutetest.WithRegistry(reg), kvroutetest.WithNumBlocks(1 << 15), kvroutetest.WithStreamHandles(true)}
	pMain := kvroutetest.NewEngine(t, common...)
	pOld := kvroutetest.NewEngine(t, append(common, kvroutetest.WithPrefillHandleOnLengthOnly(true))...)
	dReal := kvroutetest.NewEngine(t, append(common,
		kvroutetest.WithProfile(kvroutetest.Profile{Name: "soak", InterTokenLatency: soakITL}), kvroutetest.WithSpeed(1))...)

	s := &soak{wire: &soakWire{}, pOld: pOld.URL()}
	pTr, dTr := &http.Transport{}, &http.Transport{}
	pMainRP, pOldRP := reverseProxy(t, pMain.URL(), pTr), reverseProxy(t, pOld.URL(), pTr)
	prefill := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get(soakModeHeader) == soakLengthOnly {
			pOldRP.ServeHTTP(w, r)
			return
		}
		pMainRP.ServeHTTP(w, r)
	}))
	s.fake = &fakeDecode{real: reverseProxy(t, dReal.URL(), dTr), n: map[string]int{}}
	decode := httptest.NewServer(s.fake)
	s.decURL = decode.URL
	t.Cleanup(func() { // after the proxy stops
		prefill.Close()
		decode.Close()
		pTr.CloseIdleConnections()
		dTr.CloseIdleConnections()
	})

	s.proxy = startInProcess(t, nil, "--prefill", prefill.URL, "--decode", decode.URL,
		"--idle-conn-timeout", soakIdleConn.String(), "--read-body-timeout", soakReadBody.String(),
		"--read-header-timeout", soakReadHeader.String(),
		"--max-concurrent-turns", strconv.Itoa(soakMaxTurns),
		"--max-body-bytes", strconv.Itoa(soakMaxBody), "--max-buffered-bytes", strconv.Itoa(soakMaxBuffered),
		"--client-write-timeout", "10s", "--shutdown-grace", "2s")
	// Shorter than the proxy's idle timeout: the client drops an idle
	// connection before the proxy does, so no request races its close.
	tr := &http.Transport{DialContext: s.wire.dial, IdleConnTimeout: soakIdleConn / 3, MaxIdleConnsPerHost: 32}
	s.client = &http.Client{Transport: tr}
	t.Cleanup(tr.CloseIdleConnections) // before the proxy stops
	return s
}

// reverseProxy returns a dispatcher's route to the engine at raw. It reads
// the request body to its end, then forwards a copy of it, never r.Body
// itself. Forwarding r.Body (not one of the in-memory readers it knows),
// the Transport flushes the request header, writes the Content-Length
// bytes straight to the engine, and only then reads the body once more, to
// see its EOF. The engine, which has the whole body, can answer before that
// read, and the ReverseProxy (FlushInterval -1) flushes the answer's header
// at once; a Go HTTP/1 server, when a handler flushes its header, reads what
// is left of the request body and closes it ("the request body may be
// unavailable", http.ResponseWriter). The Transport's late read then fails
// (http.ErrBodyReadAfterClose), it closes its connection to the engine as
// after any failed request write, and the ReverseProxy aborts the answer
// it is copying: a stream the engine never cut ends, for the router, in
// unexpected EOF. TestSoakDispatcherLateEOF makes that race certain.
func reverseProxy(t *testing.T, raw string, tr http.RoundTripper) http.Handler {
	t.Helper()
	u, err := url.Parse(raw)
	require.NoError(t, err)
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.Transport = tr
	rp.FlushInterval = -1
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		out := r.Clone(r.Context())
		out.Body, out.ContentLength, out.TransferEncoding = io.NopCloser(bytes.NewReader(body)), int64(len(body)), nil
		rp.ServeHTTP(w, out)
	})
}

// next returns a number unique in the run, for prompts no earlier turn shares.
func (s *soak) next() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	return s.seq
}

// ---- part 1: connections closed at their deadlines ----

// phaseA runs the connection probes while the malformed-engine modes and
// the stop-on-first-token turns go through the same proxy.
func (s *soak) phaseA(t *testing.T, rs *soakRound) {
	var wg sync.WaitGroup
	defer wg.Wait() // also when a require below fails: no probe outlives the test
	var mu sync.Mutex
	record := func(dst *[]time.Duration, d time.Duration) {
		mu.Lock()
		*dst = append(*dst, d)
		mu.Unlock()
	}
	var open atomic.Int32 // probe connections open now, as the client sees them
	probe := func(name string, f func(c net.Conn, r *bufio.Reader) (time.Duration, bool)) {
		wg.Add(1)
		open.Add(1)
		go func() {
			defer wg.Done()
			c, err := s.wire.dial(context.Background(), "tcp", s.proxy.addr)
			if !assert.NoError(t, err, name) {
				open.Add(-1)
				return
			}
			defer c.Close()
			_ = c.SetDeadline(time.Now().Add(10 * time.Second))
			if _, ok := f(c, bufio.NewReader(c)); !ok {
				t.Errorf("%s: not closed as expected", name)
			}
			open.Add(-1)
		}()
	}
	// untilClosed reads to EOF and returns the time from ref, failing if
	// the connection is not closed by within.
	untilClosed := func(name string, c net.Conn, r *bufio.Reader, ref time.Time, want time.Duration) (time.Duration, bool) {
		_ = c.SetReadDeadline(ref.Add(want + soakSlack))
		_, err := io.Copy(io.Discard, r)
		took := time.Since(ref)
		var ne net.Error
		if errors.As(err, &ne) && ne.Timeout() {
			t.Errorf("%s: still open %v after its last activity (deadline %v + slack %v)", name, took.Round(time.Millisecond), want, soakSlack)
			return took, false
		}
		if took < want-soakEarly {
			t.Errorf("%s: closed after %v, before its deadline %v", name, took.Round(time.Millisecond), want)
			return took, false
		}
		return took, true
	}
	// trickle writes one byte every 50 ms until the proxy closes c.
	trickle := func(c net.Conn, b byte, done <-chan struct{}) {
		defer wg.Done()
		tick := time.NewTicker(50 * time.Millisecond)
		defer tick.Stop()
		for range 100 { // 5 s at most
			select {
			case <-done:
				return
			case <-tick.C:
			}
			if _, err := c.Write([]byte{b}); err != nil {
				return
			}
		}
	}

	// Idle keep-alive connections: one request each, then nothing.
	for i := range 6 {
		probe(fmt.Sprintf("idle keep-alive %d", i), func(c net.Conn, r *bufio.Reader) (time.Duration, bool) {
			if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: soak\r\n\r\n"); !assert.NoError(t, err) {
				return 0, false
			}
			resp, err := http.ReadResponse(r, nil)
			if !assert.NoError(t, err) {
				return 0, false
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			d, ok := untilClosed("idle keep-alive", c, r, time.Now(), soakIdleConn)
			record(&rs.idleClose, d)
			return d, ok
		})
	}
	// slowBody sends request's headers, then trickles its body: the
	// proxy answers status in OpenAI's shape and closes the connection at
	// --read-body-timeout from the end of the headers.
	slowBody := func(label, request string, status int, code string, into *[]time.Duration) {
		probe(label, func(c net.Conn, r *bufio.Reader) (time.Duration, bool) {
			if _, err := io.WriteString(c, request); !assert.NoError(t, err) {
				return 0, false
			}
			ref := time.Now()
			done := make(chan struct{})
			defer close(done)
			wg.Add(1)
			go trickle(c, ' ', done)
			resp, err := http.ReadResponse(r, nil)
			if !assert.NoError(t, err) {
				return 0, false
			}
			b, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			assertJSONError(t, resp.StatusCode, resp.Header, string(b), status, code)
			d, ok := untilClosed(label, c, r, ref, soakReadBody)
			record(into, d)
			return d, ok
		})
	}
	// A trickling body on the completion route: 408.
	slowBody("slow body (completion)", "POST /v1/chat/completions HTTP/1.1\r\nHost: soak\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{",
		http.StatusRequestTimeout, "request_timeout", &rs.slowBodyClose)
	rs.slowBodyTurns = 1
	// Trickling bodies on a route that does not read them: answered at
	// once, closed at the body deadline.
	for i := range 2 {
		slowBody(fmt.Sprintf("slow body (/health) %d", i), "POST /health HTTP/1.1\r\nHost: soak\r\nContent-Length: 1000\r\n\r\n{",
			http.StatusMethodNotAllowed, "method_not_allowed", &rs.slowHealthClose)
	}
	// Headers that trickle in: closed at --read-header-timeout, no answer.
	probe("slow headers", func(c net.Conn, r *bufio.Reader) (time.Duration, bool) {
		if _, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: soak\r\nX-Slow: "); !assert.NoError(t, err) {
			return 0, false
		}
		ref := time.Now()
		done := make(chan struct{})
		defer close(done)
		wg.Add(1)
		go trickle(c, 'a', done)
		d, ok := untilClosed("slow headers", c, r, ref, soakReadHeader)
		record(&rs.slowHeaderClose, d)
		return d, ok
	})
	// A control: a keep-alive connection used every 150 ms stays open for
	// twice the idle timeout.
	wg.Add(1)
	go func() {
		defer wg.Done()
		c, err := s.wire.dial(context.Background(), "tcp", s.proxy.addr)
		if !assert.NoError(t, err) {
			return
		}
		defer c.Close()
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		r := bufio.NewReader(c)
		end := time.Now().Add(2 * soakIdleConn)
		var lastDone time.Time // when the previous answer was read
		for i := 0; i < 100 && time.Now().Before(end); i++ {
			// The proxy finished the previous answer before we read it, so
			// the connection has been idle at least gap when we write: a
			// close after a gap of the idle timeout or more (a stalled
			// client on an overloaded machine) is the proxy doing its job.
			gap := time.Since(lastDone)
			_, err := io.WriteString(c, "GET /health HTTP/1.1\r\nHost: soak\r\n\r\n")
			var resp *http.Response
			if err == nil {
				resp, err = http.ReadResponse(r, nil)
			}
			if err != nil && i > 0 && gap >= soakIdleConn {
				t.Logf("control request %d: closed after the client stalled %v (idle timeout %v): not a failure", i, gap.Round(time.Millisecond), soakIdleConn)
				return
			}
			if !assert.NoError(t, err, "control request %d: the active connection was closed (idle %v)", i, gap.Round(time.Millisecond)) {
				return
			}
			_, _ = io.Copy(io.Discard, resp.Body)
			_ = resp.Body.Close()
			lastDone = time.Now()
			assert.Equal(t, http.StatusOK, resp.StatusCode)
			mu.Lock()
			rs.controlRequests++
			mu.Unlock()
			time.Sleep(150 * time.Millisecond)
		}
	}()

	// Parts 4 and 5 meanwhile, one turn at a time (the slow completion
	// body above holds one of the turn slots).
	rs.modes = s.malformedModes(t, soakModes)
	rs.stopFirst = s.stopOnFirstToken(t)

	// Every probe connection is closed by its deadline plus the slack.
	wait := time.Now().Add(max(soakIdleConn, soakReadBody, soakReadHeader) + soakSlack + time.Second)
	for open.Load() > 0 && time.Now().Before(wait) {
		time.Sleep(10 * time.Millisecond)
	}
	assert.Zero(t, open.Load(), "probe connections still open at their deadline plus %v", soakSlack)
}

// ---- part 4: no handle bytes from malformed decode engines ----

// soakMode is one behaviour of the fake decode engine and what the client
// must get.
type soakMode struct {
	name   string
	stream bool   // the client's request streams
	want   string // "answer", "200" (scrubbed, not a completion), "502" or "sse-error"
}

// soakLeakModes are malformed answers whose handle bytes reached the
// client before the fix (TestSoakKnownHandleLeaks): handle members on a
// non-data line that does not spell kv_transfer_params (the line is now
// dropped), and a handle nested below a choice, in its delta or message
// (now removed at any depth, as sse.Scrub does).
var soakLeakModes = []soakMode{
	{"comment-value", true, "answer"},
	{"id-value", true, "answer"},
	{"event-value", true, "answer"},
	{"delta-nested", true, "answer"},
	{"message-nested", false, "answer"},
}

var soakModes = []soakMode{
	{"nonjson", false, "502"},
	{"nonjson", true, "502"},
	{"array", false, "200"},
	{"array", true, "200"},
	{"json-ok", false, "answer"},
	{"json-escaped", false, "answer"},
	{"comment", true, "answer"},
	{"id", true, "answer"},
	{"choices", true, "answer"},
	{"toplevel", true, "answer"},
	{"split", true, "answer"},
	{"multiline", true, "answer"},
	{"escaped", true, "answer"},
	{"data-array", true, "200"},
	{"huge", true, "answer"},
}

func (s *soak) malformedModes(t *testing.T, modes []soakMode) int {
	t.Helper()
	for _, m := range modes {
		n := s.next()
		body, err := json.Marshal(map[string]any{
			"model": "sim-model", "max_tokens": 6, "stream": m.stream,
			"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("soak turn %d: the fake decode engine answers in mode %s; tell me about foxes", n, m.name)}},
		})
		require.NoError(t, err)
		a, err := s.post(body, m.name, false)
		if m.want != "200" { // a scrubbed answer that is not a completion is no error
			require.NoError(t, err, "mode %s", m.name)
		}
		label := fmt.Sprintf("mode %s (stream %v): %d %s", m.name, m.stream, a.status, clip(a.raw))
		assertNoHandle(t, a.raw, label)
		switch m.want {
		case "answer":
			require.Equal(t, http.StatusOK, a.status, label)
			assert.True(t, a.done || !m.stream, "%s: ends with data: [DONE]", label)
			assert.Empty(t, a.errEvent, label)
			assert.Equal(t, reference(t, body), a.text, label)
		case "200":
			require.Equal(t, http.StatusOK, a.status, label)
		case "502":
			require.Equal(t, http.StatusBadGateway, a.status, label)
			assert.Equal(t, "application/json", a.header.Get("Content-Type"), label)
			var e struct {
				Error struct {
					Message, Type, Code string
					Param               *string
				} `json:"error"`
			}
			require.NoError(t, json.Unmarshal(a.raw, &e), label)
			assert.Equal(t, "server_error", e.Error.Type, label)
			assert.Equal(t, "decode_failed", e.Error.Code, label)
			assert.Contains(t, e.Error.Message, "kvroute: decode failed", label)
			assert.NotContains(t, e.Error.Message, s.decURL, "%s: no engine address reaches a client", label)
		case "sse-error":
			require.Equal(t, http.StatusOK, a.status, label)
			assert.False(t, a.done, "%s: no data: [DONE] after an error", label)
			assert.Contains(t, a.errEvent, `"type":"server_error"`, label)
			assert.Contains(t, a.errEvent, "_failed", label)
		}
	}
	return len(modes)
}

func clip(b []byte) string {
	if len(b) > 400 {
		return string(b[:400]) + "…"
	}
	return string(b)
}

func assertNoHandle(t *testing.T, b []byte, label string) {
	t.Helper()
	for _, nd := range soakNeedles {
		assert.NotContains(t, string(b), nd, "%s: handle bytes reached the client", label)
	}
}

// fakeDecode is the decode dispatcher: requests with a malformed mode get
// the fake engine's answer, every other request goes to the real decode
// engine.
type fakeDecode struct {
	real http.Handler
	mu   sync.Mutex
	n    map[string]int // decode legs served per mode
}

func (f *fakeDecode) counts() map[string]int {
	f.mu.Lock()
	defer f.mu.Unlock()
	out := make(map[string]int, len(f.n))
	for k, v := range f.n {
		out[k] = v
	}
	return out
}

// fakeHandle is a two-group D handle with n block ids per group.
func fakeHandle(n int) string {
	var b strings.Builder
	b.WriteString(`{"do_remote_prefill":false,"do_remote_decode":false,"remote_block_ids":[`)
	for g := range 2 {
		if g > 0 {
			b.WriteByte(',')
		}
		b.WriteByte('[')
		for i := range n {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteString(strconv.Itoa(100000 + g*n + i))
		}
		b.WriteByte(']')
	}
	fmt.Fprintf(&b, `],"remote_engine_id":"soak-fake-engine","remote_request_id":"soak-fake-req","remote_host":"127.0.0.1","remote_port":5999,"remote_num_tokens":%d,"tp_size":1}`, 16*n)
	return b.String()
}

func (f *fakeDecode) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	mode := r.Header.Get(soakModeHeader)
	known := false
	for _, m := range append(soakModes[:len(soakModes):len(soakModes)], soakLeakModes...) {
		known = known || m.name == mode
	}
	if !known {
		f.real.ServeHTTP(w, r)
		return
	}
	f.mu.Lock()
	f.n[mode]++
	f.mu.Unlock()
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	ans, err := kvroutetest.Reference(r.URL.Path, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	text, _ := json.Marshal(ans.Text)
	h := fakeHandle(3)
	const head = `{"id":"chatcmpl-soak","object":"chat.completion.chunk","created":1,"model":"sim-model","choices":[{"index":0,`
	chunk := func(delta, finish, inChoice, top string) string {
		return head + `"delta":` + delta + `,"logprobs":null,"finish_reason":` + finish + inChoice + `}]` + top + `}`
	}
	first := "data: " + chunk(`{"role":"assistant","content":""}`, "null", "", "") + "\n\n"
	content := "data: " + chunk(`{"content":`+string(text)+`}`, "null", "", "") + "\n\n"
	final := func(inChoice, top string) string {
		return "data: " + chunk(`{}`, `"length"`, inChoice, top) + "\n\n"
	}
	const done = "data: [DONE]\n\n"
	full := `{"id":"chatcmpl-soak","object":"chat.completion","created":1,"model":"sim-model","choices":[{"index":0,"message":{"role":"assistant","content":` +
		string(text) + `},"logprobs":null,"finish_reason":"length","stop_reason":null%s}],"usage":{"prompt_tokens":1,"total_tokens":2,"completion_tokens":1}%s}`

	send := func(ct string, parts ...string) {
		w.Header().Set("Content-Type", ct)
		w.WriteHeader(http.StatusOK)
		rc := http.NewResponseController(w)
		for _, p := range parts {
			if p == "" {
				time.Sleep(15 * time.Millisecond) // a pause between two reads
				continue
			}
			_, _ = io.WriteString(w, p)
			_ = rc.Flush()
		}
	}
	const sse = "text/event-stream"
	switch mode {
	case "nonjson":
		send("application/json", `upstream: ok, kv_transfer_params=`+h)
	case "array":
		send("application/json", `[`+fmt.Sprintf(full, "", `,"kv_transfer_params":`+h)+`]`)
	case "json-ok":
		send("application/json", fmt.Sprintf(full, `,"kv_transfer_params":`+h, `,"kv_transfer_params":`+h))
	case "json-escaped":
		send("application/json", fmt.Sprintf(full, `,"kv\u005ftransfer_params":`+h, `,"kv\u005ftransfer_params":`+h))
	case "comment":
		send(sse, ": kv_transfer_params "+h+"\n\n", first, `: {"kv_transfer_params":`+h+"}\n"+content, final("", ""), done)
	case "id":
		send(sse, first, `id: {"kv_transfer_params":`+h+"}\n"+content, final("", ""), done)
	case "choices":
		send(sse, first, content, final(`,"kv_transfer_params":`+h, ""), done)
	case "toplevel":
		send(sse, first, content, final("", `,"kv_transfer_params":`+h), done)
	case "split":
		ev := final("", `,"kv_transfer_params":`+h)
		i := strings.Index(ev, "kv_trans") + len("kv_trans")
		j := strings.Index(ev, "remote_blo") + len("remote_blo")
		k := strings.Index(ev, "remote_engine") + len("remote_en")
		send(sse, first, content, ev[:i], "", ev[i:j], "", ev[j:k], "", ev[k:len(ev)-1], "", ev[len(ev)-1:], done)
	case "multiline":
		ev := chunk(`{}`, `"length"`, "", "")
		send(sse, first, content, "data: "+ev[:len(ev)-1]+",\ndata: \"kv_transfer_params\":"+h+"}\n\n", done)
	case "escaped":
		send(sse, first, content, final("", `,"kv\u005ftransfer_params":`+h), done)
	case "data-array":
		send(sse, first, content, `data: [{"kv_transfer_params":`+h+"}]\n\n", final("", ""), done)
	case "comment-value":
		send(sse, first, ": "+h+"\n"+content, final("", ""), done)
	case "id-value":
		send(sse, first, "id: "+h+"\n"+content, final("", ""), done)
	case "event-value":
		send(sse, first, "event: "+h+"\n"+content, final("", ""), done)
	case "delta-nested":
		send(sse, first, "data: "+chunk(`{"content":`+string(text)+`,"kv_transfer_params":`+h+`}`, "null", "", "")+"\n\n", final("", ""), done)
	case "message-nested":
		send("application/json", strings.Replace(fmt.Sprintf(full, "", ""), `"message":{`, `"message":{"kv_transfer_params":`+h+`,`, 1))
	case "huge":
		// A final event over 1 MiB: a two-group handle of about 1.1 MB.
		send(sse, first, content, final("", `,"kv_transfer_params":`+fakeHandle(80000)), done)
	}
}

// ---- part 5: a stop on P's first token against an older prefill engine ----

func (s *soak) stopOnFirstToken(t *testing.T) int {
	t.Helper()
	turns := 0
	for _, stream := range []bool{false, true} {
		n := s.next()
		msgs := []map[string]string{{"role": "user", "content": fmt.Sprintf("soak turn %d: say one word about the river and stop", n)}}
		probe, err := json.Marshal(map[string]any{"model": "sim-model", "messages": msgs, "max_tokens": 1})
		require.NoError(t, err)
		firstTok, err := kvroutetest.Reference("/v1/chat/completions", probe)
		require.NoError(t, err)
		require.NotEmpty(t, firstTok.Text, "P's first token has text")
		req := map[string]any{"model": "sim-model", "messages": msgs, "max_tokens": 12, "stop": []string{firstTok.Text}, "stream": stream}
		body, err := json.Marshal(req)
		require.NoError(t, err)
		want, err := kvroutetest.Reference("/v1/chat/completions", body)
		require.NoError(t, err)
		require.Equal(t, "stop", want.FinishReason, "the stop matches the first token")
		require.Equal(t, 1, want.CompletionTokens, "the stop matches the first token")

		if !stream && s.pOld != "" {
			// The control: the older engine, sent the prefill leg with the
			// client's stop, stops on it and withholds its handle.
			s.pOldNoHandle(t, msgs, firstTok.Text)
		}

		a, err := s.post(body, soakLengthOnly, false)
		require.NoError(t, err)
		label := fmt.Sprintf("stop on the first token (stream %v): %d %s", stream, a.status, clip(a.raw))
		assertNoHandle(t, a.raw, label)
		require.Equal(t, http.StatusOK, a.status, label)
		assert.Equal(t, want.Text, a.text, label)
		assert.True(t, a.done || !stream, label)
		turns++
	}
	return turns
}

// pOldNoHandle checks, directly against the older prefill engine, that a
// one-token prefill leg that kept the client's stop gets no handle, and one
// without it does: what the router must drop for the turn to succeed.
func (s *soak) pOldNoHandle(t *testing.T, msgs []map[string]string, stop string) {
	t.Helper()
	for _, withStop := range []bool{true, false} {
		leg := map[string]any{"model": "sim-model", "messages": msgs, "max_tokens": 1, "stream": false, "ignore_eos": true,
			"kv_transfer_params": map[string]any{"do_remote_decode": true, "do_remote_prefill": false,
				"remote_engine_id": nil, "remote_block_ids": nil, "remote_host": nil, "remote_port": nil}}
		if withStop {
			leg["stop"] = []string{stop}
		}
		b, err := json.Marshal(leg)
		require.NoError(t, err)
		resp, err := http.Post(s.pOld+"/v1/chat/completions", "application/json", bytes.NewReader(b))
		require.NoError(t, err)
		out, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, string(out))
		var r struct {
			KV      json.RawMessage `json:"kv_transfer_params"`
			Choices []struct {
				FinishReason string `json:"finish_reason"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal(out, &r), string(out))
		hasHandle := len(r.KV) > 0 && string(r.KV) != "null"
		if withStop {
			assert.False(t, hasHandle, "the older engine withholds its handle when it stops on a stop string: %s", out)
			if assert.Len(t, r.Choices, 1) {
				assert.Equal(t, "stop", r.Choices[0].FinishReason)
			}
		} else {
			assert.True(t, hasHandle, "the older engine emits its handle on its length cap: %s", out)
		}
	}
	s.pOld = "" // once per run
}

// ---- part 3: shedding above --max-concurrent-turns ----

func (s *soak) phaseShed(t *testing.T, rs *soakRound) {
	t.Helper()
	s.settle(t)
	type result struct {
		a    soakAnswer
		err  error
		took time.Duration
		body []byte
	}
	streamBody := func() []byte {
		b, _ := json.Marshal(map[string]any{
			"model": "sim-model", "stream": true, "stream_options": map[string]any{"include_usage": false},
			"max_tokens": soakStreamTokens, "ignore_eos": true,
			"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("soak turn %d: a slow story about a heron", s.next())}},
		})
		return b
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	slow := make([]result, soakMaxTurns)
	for i := range slow {
		slow[i].body = streamBody()
		wg.Add(1)
		go func() {
			defer wg.Done()
			start := time.Now()
			slow[i].a, slow[i].err = s.post(slow[i].body, "", false)
			slow[i].took = time.Since(start)
		}()
	}
	// Every slot is taken: shed what comes now.
	full := false
	for range 500 {
		if metricValue(s.metrics(t), "bidikv_inflight_turns") == strconv.Itoa(soakMaxTurns) {
			full = true
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	require.True(t, full, "the slow streams hold every turn slot")
	shed := make([]result, 2*soakMaxTurns)
	var shedWG sync.WaitGroup
	for i := range shed {
		shed[i].body = streamBody()
		shedWG.Add(1)
		go func() {
			defer shedWG.Done()
			start := time.Now()
			shed[i].a, shed[i].err = s.post(shed[i].body, "", false)
			shed[i].took = time.Since(start)
		}()
	}
	shedWG.Wait()
	for i, r := range shed {
		if !assert.NoError(t, r.err, "shed request %d", i) {
			continue
		}
		assertNoHandle(t, r.a.raw, "shed")
		assertJSONError(t, r.a.status, r.a.header, string(r.a.raw), http.StatusServiceUnavailable, "overloaded")
		assert.Equal(t, "1", r.a.header.Get("Retry-After"))
		assert.Contains(t, string(r.a.raw), "--max-concurrent-turns")
		rs.shedTurns++
		rs.shedMax = max(rs.shedMax, r.took)
	}
	wg.Wait()
	for i, r := range slow {
		if !assert.NoError(t, r.err, "slow stream %d", i) {
			continue
		}
		label := fmt.Sprintf("slow stream %d: %d %s", i, r.a.status, clip(r.a.raw))
		assertNoHandle(t, r.a.raw, label)
		if assert.Equal(t, http.StatusOK, r.a.status, label) {
			assert.True(t, r.a.done, "%s: ends with data: [DONE]", label)
			assert.Equal(t, reference(t, r.body), r.a.text, label)
			rs.admitted++
		}
		rs.streamMax = max(rs.streamMax, r.took)
	}
	assert.Greater(t, rs.streamMax, soakReadBody, "the streams outlive --read-body-timeout")
	assert.Less(t, rs.shedMax, rs.streamMax, "shed at once, not after the admitted turns")
}

// ---- part 2: the buffered-bytes bound under a burst of large bodies ----

// bigBody is a chat request of exactly soakMaxBody bytes.
func bigBody(t *testing.T, n int) []byte {
	t.Helper()
	mk := func(pad int) []byte {
		b, err := json.Marshal(map[string]any{
			"model": "sim-model", "stream": true, "max_tokens": soakStreamTokens, "ignore_eos": true,
			"messages": []map[string]string{{"role": "user", "content": fmt.Sprintf("soak turn %d: a long letter ", n) + strings.Repeat("x", pad)}},
		})
		require.NoError(t, err)
		return b
	}
	b := mk(0)
	b = mk(soakMaxBody - len(b))
	require.Len(t, b, soakMaxBody)
	return b
}

func (s *soak) phaseBurst(t *testing.T, rs *soakRound) {
	t.Helper()
	s.settle(t)
	const burst = 10
	stop := make(chan struct{})
	var sampler sync.WaitGroup
	defer sampler.Wait()
	sampler.Add(1)
	go func() {
		defer sampler.Done()
		for range 5000 { // bounded: the burst lasts about a second
			select {
			case <-stop:
				return
			default:
			}
			page, err := s.metricsPage()
			if err != nil {
				continue
			}
			b, errB := strconv.ParseInt(metricValue(page, "bidikv_buffered_request_bytes"), 10, 64)
			in, errI := strconv.ParseInt(metricValue(page, "bidikv_inflight_turns"), 10, 64)
			if errB == nil && errI == nil {
				rs.burstSamples++
				rs.maxBuffered = max(rs.maxBuffered, b)
				rs.maxInflight = max(rs.maxInflight, in)
			}
			time.Sleep(2 * time.Millisecond)
		}
	}()
	type result struct {
		a    soakAnswer
		err  error
		body []byte
	}
	res := make([]result, burst)
	var wg sync.WaitGroup
	for i := range res {
		res[i].body = bigBody(t, s.next())
		wg.Add(1)
		go func() {
			defer wg.Done()
			res[i].a, res[i].err = s.post(res[i].body, "", i%2 == 1) // half of them chunked
		}()
	}
	wg.Wait()
	close(stop)
	sampler.Wait()
	for i, r := range res {
		if !assert.NoError(t, r.err, "large body %d (chunked %v)", i, i%2 == 1) {
			continue
		}
		label := fmt.Sprintf("large body %d (chunked %v): %d %s", i, i%2 == 1, r.a.status, clip(r.a.raw))
		assertNoHandle(t, r.a.raw, label)
		switch r.a.status {
		case http.StatusOK:
			assert.True(t, r.a.done, label)
			assert.Equal(t, reference(t, r.body), r.a.text, label)
			rs.burstAdmitted++
		case http.StatusServiceUnavailable:
			// Shed for bytes as they arrive, or for turns once a body
			// is in and every turn slot is taken.
			assertJSONError(t, r.a.status, r.a.header, string(r.a.raw), http.StatusServiceUnavailable, "overloaded")
			assert.Equal(t, "1", r.a.header.Get("Retry-After"), label)
			switch {
			case strings.Contains(string(r.a.raw), "--max-buffered-bytes"):
				rs.burstShed++
			case strings.Contains(string(r.a.raw), "--max-concurrent-turns"):
				rs.burstShedTurns++
			default:
				t.Errorf("%s: shed for no known reason", label)
			}
		default:
			t.Errorf("%s: neither an answer nor 503", label)
		}
	}
	assert.Positive(t, rs.burstSamples, "the gauge was sampled during the burst")
	assert.LessOrEqual(t, rs.maxBuffered, int64(soakMaxBuffered), "buffered bytes above --max-buffered-bytes")
	assert.Positive(t, rs.maxBuffered, "the samples saw the admitted bodies")
	assert.GreaterOrEqual(t, rs.burstAdmitted, 1)
	assert.GreaterOrEqual(t, rs.burstShed+rs.burstShedTurns, burst-2*soakMaxBuffered/soakMaxBody, "the excess is shed")
}

// ---- the client side ----

// soakAnswer is one response as the client received it.
type soakAnswer struct {
	status   int
	header   http.Header
	raw      []byte
	text     string // content, joined over a stream's events
	done     bool   // data: [DONE]
	errEvent string // a stream's error event
}

// post sends a chat turn; mode goes in X-Soak-Mode for the dispatchers.
// Safe in any goroutine: it returns errors rather than failing the test.
func (s *soak) post(body []byte, mode string, chunked bool) (soakAnswer, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var r io.Reader = bytes.NewReader(body)
	if chunked {
		r = io.MultiReader(r) // hides the length: sent chunked
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.proxy.url+"/v1/chat/completions", r)
	if err != nil {
		return soakAnswer{}, err
	}
	if chunked {
		req.ContentLength = -1
	}
	req.Header.Set("Content-Type", "application/json")
	if mode != "" {
		req.Header.Set(soakModeHeader, mode)
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return soakAnswer{}, err
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		return soakAnswer{}, fmt.Errorf("reading the answer: %w (after %d bytes: %s)", err, len(raw), clip(raw))
	}
	a := soakAnswer{status: resp.StatusCode, header: resp.Header, raw: raw}
	if resp.StatusCode != http.StatusOK {
		return a, nil
	}
	type choice struct {
		Delta   struct{ Content string } `json:"delta"`
		Message struct{ Content string } `json:"message"`
	}
	if !isEventStream(resp.Header.Get("Content-Type")) {
		var c struct{ Choices []choice }
		if err := json.Unmarshal(raw, &c); err != nil || len(c.Choices) == 0 {
			return a, fmt.Errorf("not a completion: %v: %s", err, clip(raw))
		}
		a.text = c.Choices[0].Message.Content
		return a, nil
	}
	for _, l := range strings.Split(string(raw), "\n") {
		data, ok := strings.CutPrefix(strings.TrimRight(l, "\r"), "data: ")
		if !ok {
			continue
		}
		if data == "[DONE]" {
			a.done = true
			continue
		}
		var c struct {
			Choices []choice
			Error   json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal([]byte(data), &c); err != nil {
			return a, fmt.Errorf("an event is not JSON: %v: %s", err, clip([]byte(data)))
		}
		if c.Error != nil {
			a.errEvent = string(c.Error)
		}
		for _, ch := range c.Choices {
			a.text += ch.Delta.Content
		}
	}
	return a, nil
}

func (s *soak) metricsPage() (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.proxy.url+"/metrics", nil)
	if err != nil {
		return "", err
	}
	resp, err := s.client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func (s *soak) metrics(t *testing.T) string {
	t.Helper()
	page, err := s.metricsPage()
	require.NoError(t, err)
	return page
}

// settle waits, bounded, until no turn holds a slot or bytes.
func (s *soak) settle(t *testing.T) {
	t.Helper()
	for range 500 {
		page := s.metrics(t)
		if metricValue(page, "bidikv_inflight_turns") == "0" && metricValue(page, "bidikv_buffered_request_bytes") == "0" {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
	require.FailNow(t, "turns still held after the phase")
}

// soakWire dials the proxy and scans every byte read from it for handle
// bytes, across read boundaries.
type soakWire struct {
	mu    sync.Mutex
	conns int
	bytes int64
	hits  map[string]int
}

func (w *soakWire) dial(ctx context.Context, _, addr string) (net.Conn, error) {
	d := net.Dialer{Timeout: 5 * time.Second}
	c, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	w.mu.Lock()
	w.conns++
	w.mu.Unlock()
	return &soakConn{Conn: c, w: w}, nil
}

func (w *soakWire) totals() (int64, int, map[string]int) {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := map[string]int{}
	for _, nd := range soakNeedles {
		out[nd] = w.hits[nd]
	}
	return w.bytes, w.conns, out
}

// soakConn keeps the last bytes read, so that a needle split over two
// reads is found.
type soakConn struct {
	net.Conn
	w    *soakWire
	mu   sync.Mutex
	tail []byte
}

func (c *soakConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if n > 0 {
		c.mu.Lock()
		buf := append(c.tail[:len(c.tail):len(c.tail)], p[:n]...)
		found := map[string]int{}
		longest := 0
		for _, nd := range soakNeedles {
			// Not those wholly in the tail: counted by the read before.
			found[nd] = bytes.Count(buf, []byte(nd)) - bytes.Count(c.tail, []byte(nd))
			longest = max(longest, len(nd))
		}
		keep := min(len(buf), longest-1)
		c.tail = append(c.tail[:0:0], buf[len(buf)-keep:]...)
		c.mu.Unlock()
		c.w.mu.Lock()
		c.w.bytes += int64(n)
		if c.w.hits == nil {
			c.w.hits = map[string]int{}
		}
		for k, v := range found {
			c.w.hits[k] += v
		}
		c.w.mu.Unlock()
	}
	return n, err
}
