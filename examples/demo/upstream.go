package main

import (
	"io"
	"net/http"
	"strings"
	"sync"
	"time"
)

// upstreamClock is a RoundTripper that measures how long each turn waited on
// the engines, keyed by X-Request-Id: for a non-streaming answer (the prefill
// leg) until its body is read to the end, for a stream (the decode leg)
// until its first bytes. A turn's time to first token minus this wait is
// what the router itself added.
type upstreamClock struct {
	rt    http.RoundTripper
	mu    sync.Mutex
	waits map[string]time.Duration
}

func newUpstreamClock(rt http.RoundTripper) *upstreamClock {
	return &upstreamClock{rt: rt, waits: make(map[string]time.Duration)}
}

func (u *upstreamClock) RoundTrip(req *http.Request) (*http.Response, error) {
	id := req.Header.Get("X-Request-Id")
	start := time.Now()
	resp, err := u.rt.RoundTrip(req)
	if err != nil {
		u.add(id, time.Since(start))
		return nil, err
	}
	stream := strings.HasPrefix(resp.Header.Get("Content-Type"), "text/event-stream")
	resp.Body = &timedBody{ReadCloser: resp.Body, u: u, id: id, start: start, stream: stream}
	return resp, nil
}

func (u *upstreamClock) add(id string, d time.Duration) {
	u.mu.Lock()
	u.waits[id] += d
	u.mu.Unlock()
}

// take returns and forgets the wait recorded for id.
func (u *upstreamClock) take(id string) time.Duration {
	u.mu.Lock()
	defer u.mu.Unlock()
	d := u.waits[id]
	delete(u.waits, id)
	return d
}

type timedBody struct {
	io.ReadCloser
	u      *upstreamClock
	id     string
	start  time.Time
	stream bool
	once   sync.Once
}

func (b *timedBody) Read(p []byte) (int, error) {
	n, err := b.ReadCloser.Read(p)
	if (b.stream && n > 0) || err != nil {
		b.done()
	}
	return n, err
}

func (b *timedBody) Close() error {
	b.done()
	return b.ReadCloser.Close()
}

func (b *timedBody) done() {
	b.once.Do(func() { b.u.add(b.id, time.Since(b.start)) })
}
