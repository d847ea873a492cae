// Package upstreamclock measures how long each routed turn waited on its
// engines, so that a turn's time to first token minus that wait is what the
// router itself added. The demo and the overhead benchmarks share it.
package upstreamclock

import (
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// Clock is an http.RoundTripper that adds up, per X-Request-Id, the time
// spent on upstream requests: for a non-streaming answer (the prefill leg)
// until its body is read to the end, for a stream (the decode leg) until its
// first bytes. It is safe for concurrent use.
type Clock struct {
	rt    http.RoundTripper
	mu    sync.Mutex
	waits map[string]time.Duration
}

// New returns a Clock over rt.
func New(rt http.RoundTripper) *Clock {
	return &Clock{rt: rt, waits: make(map[string]time.Duration)}
}

// RoundTrip implements http.RoundTripper.
func (c *Clock) RoundTrip(req *http.Request) (*http.Response, error) {
	id := req.Header.Get("X-Request-Id")
	start := time.Now()
	resp, err := c.rt.RoundTrip(req)
	if err != nil {
		c.add(id, time.Since(start))
		return nil, err
	}
	stream := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	resp.Body = &body{ReadCloser: resp.Body, c: c, id: id, start: start, stream: stream}
	return resp, nil
}

func (c *Clock) add(id string, d time.Duration) {
	c.mu.Lock()
	c.waits[id] += d
	c.mu.Unlock()
}

// Take returns and forgets the wait recorded for id.
func (c *Clock) Take(id string) time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	d := c.waits[id]
	delete(c.waits, id)
	return d
}

type body struct {
	io.ReadCloser
	c      *Clock
	id     string
	start  time.Time
	stream bool
	once   sync.Once
}

func (b *body) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if (b.stream && n > 0) || err != nil {
		b.done()
	}
	return n, err
}

func (b *body) Close() error {
	b.done()
	return b.ReadCloser.Close()
}

func (b *body) done() { b.once.Do(func() { b.c.add(b.id, time.Since(b.start)) }) }
