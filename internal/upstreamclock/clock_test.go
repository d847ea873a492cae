package upstreamclock_test

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/internal/upstreamclock"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// TestClock: a body read to its end and a stream's first bytes are both
// charged to the request id, added up, and forgotten by Take.
func TestClock(t *testing.T) {
	release := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/stream" {
			w.Header().Set("Content-Type", "text/event-stream")
			_, _ = io.WriteString(w, "data: 1\n\n")
			w.(http.Flusher).Flush()
			<-release // the rest of the stream is not charged
			_, _ = io.WriteString(w, "data: 2\n\n")
			return
		}
		time.Sleep(20 * time.Millisecond)
		_, _ = io.WriteString(w, "{}")
	}))
	defer srv.Close()
	defer srv.CloseClientConnections()
	c := upstreamclock.New(http.DefaultTransport)
	hc := &http.Client{Transport: c}
	get := func(path string) *http.Response {
		req, err := http.NewRequest(http.MethodGet, srv.URL+path, nil)
		require.NoError(t, err)
		req.Header.Set("X-Request-Id", "turn-1")
		resp, err := hc.Do(req)
		require.NoError(t, err)
		return resp
	}
	resp := get("/body")
	_, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.NoError(t, resp.Body.Close())
	afterBody := c.Take("turn-1")
	assert.GreaterOrEqual(t, afterBody, 20*time.Millisecond)
	assert.Zero(t, c.Take("turn-1"), "Take forgets")

	resp = get("/stream")
	buf := make([]byte, 64)
	n, err := resp.Body.Read(buf)
	require.NoError(t, err)
	assert.Equal(t, "data: 1\n\n", string(buf[:n]))
	charged := c.Take("turn-1")
	assert.Positive(t, charged)
	close(release)
	_, _ = io.ReadAll(resp.Body)
	require.NoError(t, resp.Body.Close())
	assert.Zero(t, c.Take("turn-1"), "a stream is charged once, at its first bytes")
}

func Example() {
	c := upstreamclock.New(http.DefaultTransport)
	fmt.Println(c.Take("unknown-request"))
	// Output: 0s
}
