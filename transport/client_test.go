package transport_test

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/transport"
)

var timeouts = []error{transport.ErrFirstByteTimeout, transport.ErrIdleTimeout, transport.ErrTotalTimeout}

// assertOnly checks that err matches want and none of the other deadline
// sentinels nor context.Canceled (unless want is context.Canceled).
func assertOnly(t *testing.T, err, want error) {
	t.Helper()
	require.Error(t, err)
	assert.ErrorIs(t, err, want)
	for _, other := range append(timeouts, context.Canceled) {
		if other != want {
			assert.NotErrorIs(t, err, other)
		}
	}
}

func get(t *testing.T, ctx context.Context, url string) *http.Request {
	t.Helper()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, strings.NewReader(`{"x":1}`))
	require.NoError(t, err)
	return req
}

func TestDoFirstByteTimeoutRealClock(t *testing.T) {
	for _, host := range loopbacks {
		t.Run(host, func(t *testing.T) {
			s := newStall(t, false, "")
			srv, c := newServer(t, host, s)
			resp, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{FirstByte: 20 * time.Millisecond})
			assert.Nil(t, resp)
			assertOnly(t, err, transport.ErrFirstByteTimeout)
			var te interface{ Timeout() bool }
			require.ErrorAs(t, err, &te)
			assert.True(t, te.Timeout())
		})
	}
}

func TestDoIdleTimeoutRealClock(t *testing.T) {
	for _, host := range loopbacks {
		t.Run(host, func(t *testing.T) {
			s := newStall(t, true, "data: 1\n\n")
			srv, c := newServer(t, host, s)
			resp, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{FirstByte: time.Minute, Idle: 20 * time.Millisecond})
			require.NoError(t, err)
			defer resp.Body.Close()
			buf := make([]byte, len(s.prefix))
			_, err = io.ReadFull(resp.Body, buf)
			require.NoError(t, err)
			assert.Equal(t, s.prefix, string(buf))
			_, err = resp.Body.Read(buf)
			assertOnly(t, err, transport.ErrIdleTimeout)
		})
	}
}

func TestDoDeadlinesVirtualClock(t *testing.T) {
	const (
		first = time.Hour
		idle  = 10 * time.Second
		total = 100 * time.Hour
	)
	t.Run("first byte", func(t *testing.T) {
		s := newStall(t, false, "")
		srv, c := newServer(t, "127.0.0.1", s)
		clk := &fakeClock{}
		transport.SetClock(c, clk)
		errc := make(chan error, 1)
		go func() {
			_, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{FirstByte: first, Total: total})
			errc <- err
		}()
		<-s.arrived
		clk.Advance(first - time.Nanosecond)
		select {
		case err := <-errc:
			t.Fatalf("Do returned before the deadline: %v", err)
		default:
		}
		clk.Advance(time.Nanosecond)
		assertOnly(t, <-errc, transport.ErrFirstByteTimeout)
		assert.Zero(t, clk.Active(), "timers left running")
	})
	t.Run("total before headers", func(t *testing.T) {
		s := newStall(t, false, "")
		srv, c := newServer(t, "127.0.0.1", s)
		clk := &fakeClock{}
		transport.SetClock(c, clk)
		errc := make(chan error, 1)
		go func() {
			_, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{Total: total})
			errc <- err
		}()
		<-s.arrived
		clk.Advance(total)
		assertOnly(t, <-errc, transport.ErrTotalTimeout)
	})
	t.Run("idle resets on data", func(t *testing.T) {
		next := make(chan string)
		srv, c := newServer(t, "127.0.0.1", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			w.WriteHeader(http.StatusOK)
			_ = http.NewResponseController(w).Flush()
			for {
				select {
				case chunk := <-next:
					_, _ = io.WriteString(w, chunk)
					_ = http.NewResponseController(w).Flush()
				case <-r.Context().Done():
					return
				case <-t.Context().Done():
					return
				}
			}
		}))
		clk := &fakeClock{}
		transport.SetClock(c, clk)
		resp, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{FirstByte: first, Idle: idle, Total: total})
		require.NoError(t, err)
		defer resp.Body.Close()
		buf := make([]byte, 3)
		for i := range 3 { // 3 gaps of 0.9*idle: 2.7*idle in all, never idle
			next <- "abc"
			_, err = io.ReadFull(resp.Body, buf)
			require.NoError(t, err, "chunk %d", i)
			clk.Advance(idle * 9 / 10)
		}
		clk.Advance(idle / 10)
		_, err = resp.Body.Read(buf)
		assertOnly(t, err, transport.ErrIdleTimeout)
	})
	t.Run("total mid body", func(t *testing.T) {
		s := newStall(t, true, "x")
		srv, c := newServer(t, "127.0.0.1", s)
		clk := &fakeClock{}
		transport.SetClock(c, clk)
		resp, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{Idle: total, Total: total})
		require.NoError(t, err)
		defer resp.Body.Close()
		buf := make([]byte, 1)
		_, err = io.ReadFull(resp.Body, buf)
		require.NoError(t, err)
		clk.Advance(total)
		_, err = resp.Body.Read(buf)
		assertOnly(t, err, transport.ErrTotalTimeout)
	})
}

func TestDoTimersStop(t *testing.T) {
	d := transport.Deadlines{FirstByte: time.Hour, Idle: time.Hour, Total: time.Hour}
	t.Run("on Close", func(t *testing.T) {
		s := newStall(t, true, "x")
		srv, c := newServer(t, "127.0.0.1", s)
		clk := &fakeClock{}
		transport.SetClock(c, clk)
		resp, err := c.Do(get(t, t.Context(), srv.URL), d)
		require.NoError(t, err)
		assert.Equal(t, 2, clk.Active(), "idle and total run while the body is open")
		require.NoError(t, resp.Body.Close())
		assert.Zero(t, clk.Active())
		require.NoError(t, resp.Body.Close(), "second Close")
	})
	t.Run("on EOF", func(t *testing.T) {
		srv, c := newServer(t, "127.0.0.1", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, "done")
		}))
		clk := &fakeClock{}
		transport.SetClock(c, clk)
		resp, err := c.Do(get(t, t.Context(), srv.URL), d)
		require.NoError(t, err)
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		require.NoError(t, err)
		assert.Equal(t, "done", string(b))
		assert.Zero(t, clk.Active())
		clk.Advance(2 * time.Hour) // nothing may fire any more
		_, err = resp.Body.Read(make([]byte, 1))
		assert.ErrorIs(t, err, io.EOF)
	})
	t.Run("on error", func(t *testing.T) {
		s := newStall(t, false, "")
		srv, c := newServer(t, "127.0.0.1", s)
		clk := &fakeClock{}
		transport.SetClock(c, clk)
		ctx, cancel := context.WithCancel(t.Context())
		go func() { <-s.arrived; cancel() }()
		_, err := c.Do(get(t, ctx, srv.URL), d)
		assertOnly(t, err, context.Canceled)
		assert.Zero(t, clk.Active())
	})
	t.Run("real clock leaves no goroutines", func(t *testing.T) {
		srv, c := newServer(t, "127.0.0.1", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			_, _ = io.WriteString(w, "done")
		}))
		tr, err := transport.NewTransport()
		require.NoError(t, err)
		c = transport.NewClient(tr)
		before := goleak.IgnoreCurrent()
		resp, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{FirstByte: time.Millisecond * 500, Idle: time.Millisecond * 500, Total: time.Millisecond * 500})
		require.NoError(t, err)
		_, err = io.Copy(io.Discard, resp.Body)
		require.NoError(t, err)
		require.NoError(t, resp.Body.Close())
		tr.CloseIdleConnections()
		goleak.VerifyNone(t, before)
	})
}

func TestDoCallerCancel(t *testing.T) {
	d := transport.Deadlines{FirstByte: time.Hour, Idle: time.Hour, Total: time.Hour}
	myCause := errors.New("client went away")
	for _, host := range loopbacks {
		t.Run(host+"/before headers", func(t *testing.T) {
			s := newStall(t, false, "")
			srv, c := newServer(t, host, s)
			ctx, cancel := context.WithCancel(t.Context())
			go func() { <-s.arrived; cancel() }()
			resp, err := c.Do(get(t, ctx, srv.URL), d)
			assert.Nil(t, resp)
			assertOnly(t, err, context.Canceled)
		})
		t.Run(host+"/with cause", func(t *testing.T) {
			s := newStall(t, false, "")
			srv, c := newServer(t, host, s)
			ctx, cancel := context.WithCancelCause(t.Context())
			go func() { <-s.arrived; cancel(myCause) }()
			_, err := c.Do(get(t, ctx, srv.URL), d)
			assertOnly(t, err, context.Canceled)
			assert.ErrorIs(t, err, myCause)
		})
		t.Run(host+"/mid body", func(t *testing.T) {
			s := newStall(t, true, "x")
			srv, c := newServer(t, host, s)
			ctx, cancel := context.WithCancelCause(t.Context())
			resp, err := c.Do(get(t, ctx, srv.URL), d)
			require.NoError(t, err)
			defer resp.Body.Close()
			_, err = io.ReadFull(resp.Body, make([]byte, 1))
			require.NoError(t, err)
			cancel(myCause)
			_, err = resp.Body.Read(make([]byte, 1))
			assertOnly(t, err, context.Canceled)
		})
	}
}

func TestDoCloseDuringRead(t *testing.T) {
	s := newStall(t, true, "x")
	srv, c := newServer(t, "127.0.0.1", s)
	resp, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{Idle: time.Hour})
	require.NoError(t, err)
	_, err = io.ReadFull(resp.Body, make([]byte, 1))
	require.NoError(t, err)
	errc := make(chan error, 1)
	go func() {
		_, err := resp.Body.Read(make([]byte, 8))
		errc <- err
	}()
	require.NoError(t, resp.Body.Close())
	err = <-errc
	require.Error(t, err)
	for _, sentinel := range timeouts {
		assert.NotErrorIs(t, err, sentinel)
	}
}

func TestDoPassesResponsesThrough(t *testing.T) {
	srv, c := newServer(t, "127.0.0.1", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/redirect" {
			http.Redirect(w, r, "/elsewhere", http.StatusTemporaryRedirect)
			return
		}
		body, _ := io.ReadAll(r.Body)
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.Write(body)
	}))
	tests := []struct {
		name, path string
		status     int
		body       string
	}{
		{"status and body", "/", http.StatusServiceUnavailable, `{"x":1}`},
		{"redirect not followed", "/redirect", http.StatusTemporaryRedirect, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := c.Do(get(t, t.Context(), srv.URL+tt.path), transport.Deadlines{})
			require.NoError(t, err)
			defer resp.Body.Close()
			b, err := io.ReadAll(resp.Body)
			require.NoError(t, err)
			assert.Equal(t, tt.status, resp.StatusCode)
			if tt.body != "" {
				assert.Equal(t, tt.body, string(b))
			}
		})
	}
}

type closeRecorder struct {
	io.Reader
	closed bool
}

func (c *closeRecorder) Close() error { c.closed = true; return nil }

func TestDoRejectsNegativeDeadlines(t *testing.T) {
	c := transport.NewClient(nil)
	for _, d := range []transport.Deadlines{{FirstByte: -1}, {Idle: -1}, {Total: -time.Second}} {
		t.Run("", func(t *testing.T) {
			rc := &closeRecorder{Reader: strings.NewReader("x")}
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://127.0.0.1:1/", rc)
			require.NoError(t, err)
			resp, err := c.Do(req, d)
			assert.Nil(t, resp)
			assert.ErrorIs(t, err, transport.ErrInvalidConfig)
			assert.True(t, rc.closed, "request body closed")
		})
	}
}

// TestDoSharesReadOnlyHeaders sends concurrent requests that share one
// Header map (as the router's legs of a turn do): under -race, a write to
// it by Do or net/http would be reported, and the map must come back
// unchanged.
func TestDoSharesReadOnlyHeaders(t *testing.T) {
	got := make(chan http.Header, 16)
	srv, c := newServer(t, "127.0.0.1", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		got <- r.Header.Clone()
		_, _ = io.WriteString(w, "ok")
	}))
	shared := http.Header{"Content-Type": {"application/json"}, "X-Request-Id": {"r1"}}
	want := shared.Clone()
	errs := make(chan error, 16)
	for range 16 {
		go func() {
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, srv.URL, strings.NewReader(`{"x":1}`))
			if err != nil {
				errs <- err
				return
			}
			req.Header = shared
			resp, err := c.Do(req, transport.Deadlines{FirstByte: time.Minute, Idle: time.Minute, Total: time.Minute})
			if err == nil {
				_, err = io.ReadAll(resp.Body)
				_ = resp.Body.Close()
			}
			errs <- err
		}()
	}
	for range 16 {
		require.NoError(t, <-errs)
		h := <-got
		assert.Equal(t, "r1", h.Get("X-Request-Id"))
		assert.Equal(t, "application/json", h.Get("Content-Type"))
	}
	assert.Equal(t, want, shared)
}

// TestDoErrorsAreURLErrors checks the error shape of a failed exchange:
// a *url.Error naming the method and URL, as http.Client.Do gives, with
// the request body closed.
func TestDoErrorsAreURLErrors(t *testing.T) {
	c := transport.NewClient(nil)
	rc := &closeRecorder{Reader: strings.NewReader("x")}
	// Port 1 on loopback: nothing listens there, the dial is refused.
	req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://127.0.0.1:1/v1/x", rc)
	require.NoError(t, err)
	resp, err := c.Do(req, transport.Deadlines{FirstByte: time.Minute})
	assert.Nil(t, resp)
	var ue *url.Error
	require.ErrorAs(t, err, &ue)
	assert.Equal(t, "Post", ue.Op)
	assert.Equal(t, "http://127.0.0.1:1/v1/x", ue.URL)
	var oe *net.OpError
	assert.ErrorAs(t, err, &oe)
	assert.True(t, rc.closed, "request body closed")

	req, err = http.NewRequestWithContext(t.Context(), http.MethodGet, "http://127.0.0.1:1/", nil)
	require.NoError(t, err)
	req.RequestURI = "/"
	_, err = c.Do(req, transport.Deadlines{})
	require.ErrorAs(t, err, &ue)
	assert.Contains(t, ue.Err.Error(), "RequestURI")
}
