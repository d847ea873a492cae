package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// bigAnswerEngine is a decode engine whose chat and Messages answers are
// non-streaming, with a text of size bytes and a Content-Length; it holds
// every answer until hold decode legs have arrived (or 10 s passed), then
// sends them all at once. It returns the answers' text and its chat
// answer.
func bigAnswerEngine(t *testing.T, size, hold int) (url, text, chat string) {
	t.Helper()
	text = strings.Repeat("x", size)
	chat = `{"id":"cmpl-big","object":"chat.completion","created":1,"model":"sim-model","choices":[{"index":0,"message":{"role":"assistant","content":"` +
		text + `"},"finish_reason":"stop"}],"usage":{"prompt_tokens":9,"completion_tokens":1,"total_tokens":10}}`
	messages := `{"id":"msg_big","type":"message","role":"assistant","model":"sim-model","content":[{"type":"text","text":"` +
		text + `"}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":9,"output_tokens":1}}`
	var arrived atomic.Int32
	all := make(chan struct{})
	var once sync.Once
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body := chat
		switch r.URL.Path {
		case "/health":
			return
		case "/v1/chat/completions":
		case "/v1/messages":
			body = messages
		default:
			http.NotFound(w, r)
			return
		}
		_, _ = io.Copy(io.Discard, r.Body)
		if int(arrived.Add(1)) == hold {
			once.Do(func() { close(all) })
		}
		select {
		case <-all:
		case <-time.After(10 * time.Second):
		case <-r.Context().Done():
			return
		}
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(body)))
		_, _ = io.WriteString(w, body)
	}))
	t.Cleanup(srv.Close)
	return srv.URL, text, chat
}

// Decode answers held whole count against --max-buffered-bytes with
// request bodies: eight concurrent 8 MB answers (non-streaming chat, and
// Messages streams buffered by --decode-stream buffered) with a budget of
// 20 MiB get two answers, byte for byte the engine's, while the proxy
// never holds more than the budget, and six 503s with Retry-After in the
// API's error shape, counted. Every byte is given back once the answers
// are written. The clients read their answers only once every client has
// its status, so that the two answers admitted are held meanwhile.
func TestDecodeAnswersBounded(t *testing.T) {
	for _, tc := range []struct {
		name, path, body string
		args             []string
	}{
		{name: "chat", path: "/v1/chat/completions",
			body: `{"model":"sim-model","messages":[{"role":"user","content":"write a long answer"}],"max_tokens":9000000}`},
		{name: "messages, buffered streams", path: "/v1/messages", args: []string{"--decode-stream", "buffered"},
			body: `{"model":"sim-model","max_tokens":9000000,"stream":true,"messages":[{"role":"user","content":"write a long answer"}]}`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const answers, size, budget = 8, 8_000_000, 20 << 20
			cl := kvroutetest.NewCluster(t, 1, 1)
			d, text, chat := bigAnswerEngine(t, size, answers)
			p := startInProcess(t, nil, append([]string{"--prefill", cl.Prefill[0].URL(), "--decode", d,
				"--max-body-bytes", "8MiB", "--max-buffered-bytes", "20MiB"}, tc.args...)...)

			statuses := make([]int, answers)
			bodies := make([]string, answers)
			headers := make([]http.Header, answers)
			var got, wg sync.WaitGroup
			got.Add(answers)
			for i := range answers {
				wg.Go(func() {
					resp, conn := postWithSmallWindow(t, p, tc.path, tc.body)
					defer conn.Close()
					statuses[i], headers[i] = resp.StatusCode, resp.Header
					got.Done()
					got.Wait() // every client has its status: read
					b, err := io.ReadAll(resp.Body)
					assert.NoError(t, err)
					bodies[i] = string(b)
				})
			}
			wg.Wait()

			ok := 0
			for i := range answers {
				switch statuses[i] {
				case http.StatusOK:
					ok++
					if tc.path == "/v1/chat/completions" {
						assert.True(t, bodies[i] == chat, "answer %d is not the engine's, byte for byte (%d bytes, %d sent)", i, len(bodies[i]), len(chat))
					} else {
						assert.True(t, strings.HasSuffix(bodies[i], "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n"), "answer %d: the stream's end", i)
						assert.True(t, strings.Contains(bodies[i], `"text":"`+text+`"`), "answer %d: the engine's text", i)
					}
				case http.StatusServiceUnavailable:
					assert.Equal(t, "1", headers[i].Get("Retry-After"))
					if tc.path == "/v1/messages" {
						assertAnthropicError(t, statuses[i], headers[i], bodies[i], http.StatusServiceUnavailable, "overloaded_error")
					} else {
						assertJSONError(t, statuses[i], headers[i], bodies[i], http.StatusServiceUnavailable, "overloaded")
					}
					assert.Contains(t, bodies[i], "--max-buffered-bytes")
				default:
					t.Errorf("answer %d: %d %.200s", i, statuses[i], bodies[i])
				}
			}
			assert.Equal(t, 2, ok, "two 8 MB answers fit 20 MiB, three do not")
			assert.Equal(t, strconv.Itoa(answers-ok),
				p.metric(t, `bidikv_rejected_requests_total{reason="overloaded_answer_bytes",status="503"}`))
			highF, err := strconv.ParseFloat(p.metric(t, "bidikv_buffered_bytes_high_water"), 64)
			require.NoError(t, err)
			high := int(highF)
			assert.LessOrEqual(t, high, budget)
			assert.GreaterOrEqual(t, high, 2*size, "both answers admitted were held at once")
			t.Logf("bytes charged at most: %d (%.1f MiB) for %d answers of %d bytes, budget %d", high, float64(high)/(1<<20), answers, size, budget)
			waitMetric(t, p, "bidikv_buffered_request_bytes", func(v int) bool { return v == 0 })
			assert.Equal(t, "0", p.metric(t, "bidikv_buffered_answer_bytes"))
		})
	}
}

// postWithSmallWindow sends body to path on a connection of its own whose
// receive buffer is small, so that the proxy's write of a large answer
// waits for the client to read it, and returns the response with its
// headers read.
func postWithSmallWindow(t *testing.T, p *inproc, path, body string) (*http.Response, net.Conn) {
	t.Helper()
	dl := net.Dialer{Timeout: 5 * time.Second, Control: func(_, _ string, rc syscall.RawConn) error {
		return rc.Control(func(fd uintptr) { _ = syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_RCVBUF, 4096) })
	}}
	c, err := dl.DialContext(context.Background(), "tcp", p.addr)
	require.NoError(t, err)
	require.NoError(t, c.SetDeadline(time.Now().Add(time.Minute)))
	_, err = fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", path, len(body), body)
	require.NoError(t, err)
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	require.NoError(t, err)
	return resp, c
}
