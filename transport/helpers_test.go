package transport_test

import (
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport"
)

// loopbacks lists the networks tests run on; [::1] is skipped, with a
// message, only where the machine has no IPv6 loopback.
var loopbacks = []string{"127.0.0.1", "[::1]"}

// newServer starts h on host (a loopback from loopbacks) and returns it with
// a Client on a fresh transport; both are torn down when the test ends.
func newServer(t *testing.T, host string, h http.Handler) (*httptest.Server, *transport.Client) {
	t.Helper()
	ln, err := net.Listen("tcp", net.JoinHostPort(trimBrackets(host), "0"))
	if err != nil {
		t.Skipf("no loopback listener on %s: %v", host, err)
	}
	srv := httptest.NewUnstartedServer(h)
	require.NoError(t, srv.Listener.Close())
	srv.Listener = ln
	srv.Start()
	t.Cleanup(srv.Close)
	tr, err := transport.NewTransport()
	require.NoError(t, err)
	t.Cleanup(tr.CloseIdleConnections)
	return srv, transport.NewClient(tr)
}

func trimBrackets(h string) string {
	if len(h) > 1 && h[0] == '[' && h[len(h)-1] == ']' {
		return h[1 : len(h)-1]
	}
	return h
}

// stall is a handler that writes prefix (flushed) and then blocks until
// the test ends or the client goes away. arrived receives one value per
// request once the prefix is out.
type stall struct {
	prefix  string
	headers bool // send headers (and prefix) before stalling
	arrived chan struct{}
	release <-chan struct{}
}

func newStall(t *testing.T, headers bool, prefix string) *stall {
	// t.Context is done before cleanups run, so before srv.Close waits for
	// handlers.
	return &stall{prefix: prefix, headers: headers, arrived: make(chan struct{}, 16), release: t.Context().Done()}
}

func (s *stall) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if s.headers {
		w.WriteHeader(http.StatusOK)
		_, _ = w.Write([]byte(s.prefix))
		_ = http.NewResponseController(w).Flush()
	}
	s.arrived <- struct{}{}
	select {
	case <-s.release:
	case <-r.Context().Done():
	}
}

// fakeClock is a virtual clock: timers fire only in Advance.
type fakeClock struct {
	mu     sync.Mutex
	now    time.Duration
	timers []*fakeTimer
}

type fakeTimer struct {
	c      *fakeClock
	at     time.Duration
	f      func()
	active bool
}

var _ transport.Clock = (*fakeClock)(nil)

func (c *fakeClock) AfterFunc(d time.Duration, f func()) transport.Timer {
	c.mu.Lock()
	defer c.mu.Unlock()
	t := &fakeTimer{c: c, at: c.now + d, f: f, active: true}
	c.timers = append(c.timers, t)
	return t
}

func (t *fakeTimer) Stop() bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := t.active
	t.active = false
	return was
}

func (t *fakeTimer) Reset(d time.Duration) bool {
	t.c.mu.Lock()
	defer t.c.mu.Unlock()
	was := t.active
	t.at, t.active = t.c.now+d, true
	return was
}

// Advance moves the clock and runs, in this goroutine, every timer that
// becomes due.
func (c *fakeClock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now += d
	var due []func()
	for _, t := range c.timers {
		if t.active && t.at <= c.now {
			t.active = false
			due = append(due, t.f)
		}
	}
	c.mu.Unlock()
	for _, f := range due {
		f()
	}
}

// Active counts timers that are started and neither stopped nor fired.
func (c *fakeClock) Active() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	n := 0
	for _, t := range c.timers {
		if t.active {
			n++
		}
	}
	return n
}
