package upstream_test

import (
	"context"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/transport"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// engine answers every request with status and body, and records what it
// was sent and how much of its body was read.
type engine struct {
	status  int
	body    string
	header  http.Header
	got     atomic.Pointer[http.Request]
	written atomic.Int64
}

func (e *engine) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	e.got.Store(r.Clone(context.Background()))
	for k, v := range e.header {
		w.Header()[k] = v
	}
	w.WriteHeader(e.status)
	n, _ := io.Copy(w, strings.NewReader(e.body))
	e.written.Add(n)
}

func start(t *testing.T, e *engine) (*upstream.Client, transport.Endpoint) {
	srv := httptest.NewServer(e)
	t.Cleanup(srv.Close)
	tr, err := transport.NewTransport()
	require.NoError(t, err)
	t.Cleanup(tr.CloseIdleConnections)
	ep, err := transport.ParseEndpoint(srv.URL)
	require.NoError(t, err)
	ep.Rank = 1
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	return upstream.New(transport.NewClient(tr), "k3y", func() time.Time { return now }), ep
}

// A Call carries the credential, its request id, its user agent, asks for
// identity encoding when told (and for no encoding otherwise: an engine
// sees no Accept-Encoding a client did not send), names the rank, and hands read the 2xx body up to
// its Limit.
func TestCallHeadersAndLimit(t *testing.T) {
	e := &engine{status: http.StatusOK, body: strings.Repeat("x", 100)}
	c, ep := start(t, e)
	var got []byte
	status, err := c.Call(t.Context(), ep, upstream.Call{Method: http.MethodPost, Path: "/v1/completions", Body: []byte(`{}`),
		ID: "id-1", UserAgent: "ua", Identity: true, Limit: 10}, func(r io.Reader) (err error) {
		got, err = io.ReadAll(r)
		return err
	})
	require.NoError(t, err)
	assert.Equal(t, http.StatusOK, status)
	assert.Equal(t, strings.Repeat("x", 10), string(got), "read gets at most Limit bytes")
	req := e.got.Load()
	assert.Equal(t, "Bearer k3y", req.Header.Get("Authorization"))
	assert.Equal(t, "id-1", req.Header.Get(upstream.HeaderRequestID))
	assert.Equal(t, "ua", req.Header.Get("User-Agent"))
	assert.Equal(t, "identity", req.Header.Get("Accept-Encoding"))
	assert.Equal(t, "application/json", req.Header.Get("Content-Type"))
	assert.Equal(t, "1", req.Header.Get(transport.RankHeader))
	assert.Equal(t, http.MethodPost, req.Method)

	e2 := &engine{status: http.StatusOK}
	c2, ep2 := start(t, e2)
	_, err = c2.Call(t.Context(), ep2, upstream.Call{Path: "/metrics"}, nil)
	require.NoError(t, err)
	req = e2.got.Load()
	assert.Equal(t, http.MethodGet, req.Method)
	assert.Empty(t, req.Header.Get("Content-Type"), "no body, no content type")
	assert.Empty(t, req.Header.Values(upstream.HeaderRequestID), "no id, no header")
	assert.Empty(t, req.Header.Get("Accept-Encoding"), "no encoding asked for")
}

// An answer other than 2xx is a *StatusError: its status, its body up to
// MaxErrorBody, its Retry-After.
func TestStatusError(t *testing.T) {
	long := strings.Repeat("e", upstream.MaxErrorBody*4)
	e := &engine{status: http.StatusServiceUnavailable, body: long, header: http.Header{"Retry-After": {"7"}}}
	c, ep := start(t, e)
	read := false
	status, err := c.Call(t.Context(), ep, upstream.Call{Path: "/health", Limit: 1 << 20}, func(io.Reader) error { read = true; return nil })
	assert.Equal(t, http.StatusServiceUnavailable, status)
	assert.False(t, read, "no body of an error answer is handed to read")
	var se *upstream.StatusError
	require.ErrorAs(t, err, &se)
	assert.Equal(t, http.StatusServiceUnavailable, se.Status)
	assert.Len(t, se.Body, upstream.MaxErrorBody, "bounded")
	assert.Equal(t, 7*time.Second, se.RetryAfter)
	assert.Equal(t, "Service Unavailable", err.Error(), "nothing the engine wrote")
	assert.Equal(t, http.StatusServiceUnavailable, upstream.Answered(err))
	assert.Zero(t, upstream.Answered(errors.New("no answer")))
}

// Send checks the answer of a request the caller built (a leg of a turn,
// its headers from Header): 2xx comes back open, anything else as a
// *StatusError with its body read.
func TestSend(t *testing.T) {
	for _, tc := range []struct {
		status int
		fails  bool
	}{{http.StatusOK, false}, {http.StatusCreated, false}, {http.StatusBadRequest, true}, {http.StatusFound, true}} {
		e := &engine{status: tc.status, body: `{"error":"x"}`}
		c, ep := start(t, e)
		req, err := ep.NewRequest(t.Context(), http.MethodPost, "/v1/chat/completions", strings.NewReader(`{}`))
		require.NoError(t, err)
		upstream.Header(req.Header, "turn-1", "k3y", true)
		resp, err := c.Send(req, transport.Deadlines{Total: time.Minute})
		if !tc.fails {
			require.NoError(t, err, tc.status)
			b, _ := io.ReadAll(resp.Body)
			_ = resp.Body.Close()
			assert.Equal(t, `{"error":"x"}`, string(b))
			continue
		}
		var se *upstream.StatusError
		require.ErrorAs(t, err, &se, tc.status)
		assert.Equal(t, `{"error":"x"}`, string(se.Body))
		assert.Equal(t, "turn-1", e.got.Load().Header.Get(upstream.HeaderRequestID))
	}
}

// A Call with a Timeout gives up on an engine that does not answer.
func TestCallTimeout(t *testing.T) {
	block := make(chan struct{})
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case <-block:
		case <-r.Context().Done():
		}
	}))
	defer srv.Close()
	defer close(block)
	ep, err := transport.ParseEndpoint(srv.URL)
	require.NoError(t, err)
	tr, err := transport.NewTransport()
	require.NoError(t, err)
	defer tr.CloseIdleConnections()
	c := upstream.New(transport.NewClient(tr), "", nil)
	status, err := c.Call(t.Context(), ep, upstream.Call{Path: "/metrics", Timeout: 20 * time.Millisecond}, nil)
	assert.Zero(t, status)
	assert.ErrorIs(t, err, context.DeadlineExceeded)
}
