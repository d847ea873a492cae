package main

import (
	"bufio"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// chunked encodes body as one chunk and the last chunk.
func chunked(body string) string {
	return fmt.Sprintf("%x\r\n%s\r\n0\r\n\r\n", len(body), body)
}

// A request with both Content-Length and Transfer-Encoding (which
// net/http reads as chunked, removing Content-Length before any handler
// sees it) is refused with 400 in its API's error shape and its connection
// closed, whatever the case and order of the two headers: a request
// smuggled behind it, as a front proxy that frames by Content-Length would
// forward it, is never answered. Requests with one of the two are served.
func TestAmbiguousLengthRefused(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL())
	body := chunked(goodChat)
	smuggled := "GET /v1/models HTTP/1.1\r\nHost: proxy\r\n\r\n"
	for _, tc := range []struct {
		name, path, headers, body string
	}{
		{name: "chat", path: "/v1/chat/completions",
			headers: "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", body: body},
		{name: "order and case", path: "/v1/chat/completions",
			headers: "transfer-encoding: Chunked\r\ncontent-LENGTH: 5\r\n", body: body},
		{name: "messages", path: "/v1/messages",
			headers: "Content-Length: 5\r\nTransfer-Encoding: chunked\r\n", body: body},
		{name: "a smuggled request behind it (CL.TE)", path: "/v1/chat/completions",
			headers: fmt.Sprintf("Content-Length: %d\r\nTransfer-Encoding: chunked\r\n", len(body)+len(smuggled)), body: body + smuggled},
		{name: "a route without a body", path: "/health",
			headers: "Content-Length: 0\r\nTransfer-Encoding: chunked\r\n", body: "0\r\n\r\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := p.dial(t)
			_, err := fmt.Fprintf(c, "POST %s HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n%s\r\n%s", tc.path, tc.headers, tc.body)
			require.NoError(t, err)
			br := bufio.NewReader(c)
			resp, got := rawResponse(t, br)
			if tc.path == "/v1/messages" {
				assertAnthropicError(t, resp.StatusCode, resp.Header, got, http.StatusBadRequest, "invalid_request_error")
			} else {
				assertJSONError(t, resp.StatusCode, resp.Header, got, http.StatusBadRequest, "invalid_request")
			}
			assert.Contains(t, got, "both Content-Length and Transfer-Encoding")
			assert.True(t, resp.Close, "Connection: close")
			require.NoError(t, c.SetReadDeadline(time.Now().Add(5*time.Second)))
			rest, err := io.ReadAll(br)
			assert.NoError(t, err, "closed by the proxy")
			assert.Empty(t, rest, "nothing more is answered")
		})
	}
	assert.Equal(t, "5", p.metric(t, `bidikv_rejected_requests_total{reason="ambiguous_length",status="400"}`))

	t.Run("one of the two is served", func(t *testing.T) {
		c := p.dial(t)
		br := bufio.NewReader(c)
		for _, framing := range []string{
			fmt.Sprintf("Content-Length: %d\r\n\r\n%s", len(goodChat), goodChat),
			"Transfer-Encoding: chunked\r\n\r\n" + body,
		} {
			_, err := fmt.Fprintf(c, "POST /v1/chat/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n%s", framing)
			require.NoError(t, err)
			resp, got := rawResponse(t, br)
			require.Equal(t, http.StatusOK, resp.StatusCode, got)
			assert.Contains(t, got, reference(t, []byte(goodChat)))
		}
	})
}

// headerScan notes the pair in any split of the bytes, in a head only.
func TestHeaderScan(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want bool
	}{
		{"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", true},
		{"POST / HTTP/1.1\nTRANSFER-ENCODING: chunked\nContent-length: 5\n\n", true},
		{"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nTransfer-Encoding: chunked\r\n\r\n", false},
		{"POST / HTTP/1.1\r\nX-Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", false},
		{"POST / HTTP/1.1\r\nHost: a\r\n Content-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n", false}, // a continuation of Host
		{"POST / HTTP/1.1\r\nX-Long: " + strings.Repeat("a", 100) + "\r\nContent-Length: 1\r\nTransfer-Encoding: chunked\r\n\r\n", true},
		{"GET / HTTP/1.1\r\nHost: a\r\n\r\nGET / HTTP/1.1\r\nContent-Length: 0\r\n\r\n", false},
	} {
		for step := 1; step <= len(tc.in); step++ {
			var s headerScan
			for i := 0; i < len(tc.in); i += step {
				s.scan([]byte(tc.in[i:min(i+step, len(tc.in))]))
			}
			assert.Equal(t, tc.want, s.ambiguous, "%q in reads of %d bytes", tc.in, step)
		}
	}
}
