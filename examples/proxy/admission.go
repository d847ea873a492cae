package main

import (
	"container/list"
	"net"
	"net/netip"
	"sync"
	"time"
)

// retryAfterSeconds is the Retry-After of a shed request: admitted turns
// are expected to free room within about this long.
const retryAfterSeconds = 1

// evictAfter is how long a connection must have waited for a request
// (connected or idle since its last answer) before a new connection may
// close it at --max-connections: a client that has just connected is
// sending its request.
const evictAfter = time.Second

// limits are the bounds the admission enforces, from the command line.
type limits struct {
	conns         int   // --max-connections
	transit       int   // --max-bodies-in-transit
	clientTransit int   // --max-client-bodies-in-transit, 0: no bound per client
	turns         int   // --max-concurrent-turns
	bytes         int64 // --max-buffered-bytes
}

// admission is the proxy's one admission point. It charges every client
// connection when it is accepted, every request body of a completion route
// while it arrives (a body in transit, for its client address too, and
// each of its bytes as it arrives), and every completion request once its
// body is in (a turn). It never queues: what does not fit is refused at
// once, so that what was admitted keeps its memory and finishes:
//
//   - a connection above --max-connections closes the connection that has
//     waited longest for a request, if one has waited evictAfter, and is
//     otherwise answered 503 on the raw connection and closed (listener.go);
//   - a body above --max-bodies-in-transit or
//     --max-client-bodies-in-transit, a byte above --max-buffered-bytes or
//     a complete body above --max-concurrent-turns gets 503 with
//     Retry-After in the API's error shape (admit.go).
//
// A body in transit holds no turn: clients that trickle their bodies
// cannot shed the clients whose bodies are in.
type admission struct {
	lim limits
	now func() time.Time

	mu       sync.Mutex
	conns    int
	waiting  list.List // of *clientConn waiting for a request, longest waiting first
	transit  int
	byClient map[clientKey]int // bodies in transit per client address
	turns    int
	bytes    int64
	evicted  int64 // connections closed at --max-connections
	refused  int64 // connections refused at --max-connections
}

func newAdmission(lim limits, now func() time.Time) *admission {
	if now == nil {
		now = time.Now
	}
	return &admission{lim: lim, now: now, byClient: make(map[clientKey]int)}
}

// clientKey is the address a per-client bound counts by: the IP, or for
// IPv6 its /64 (one subscriber's prefix).
type clientKey netip.Addr

// clientKeyOf returns the client key of a remote address.
func clientKeyOf(addr net.Addr) clientKey {
	ap, err := netip.ParseAddrPort(addr.String())
	if err != nil {
		return clientKey{}
	}
	ip := ap.Addr().Unmap()
	if ip.Is6() {
		if p, err := ip.Prefix(64); err == nil {
			ip = p.Addr()
		}
	}
	return clientKey(ip)
}

// connect charges a new connection. At the cap it evicts the connection
// that has waited longest for a request, when it has waited evictAfter,
// and returns it for the caller to close; with none, it refuses c.
func (a *admission) connect(c *clientConn) (evict *clientConn, ok bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.conns >= a.lim.conns {
		e := a.waiting.Front()
		if e == nil || a.now().Sub(e.Value.(*clientConn).since) < evictAfter {
			a.refused++
			return nil, false
		}
		evict = e.Value.(*clientConn)
		a.dropLocked(evict)
		a.evicted++
	}
	a.conns++
	c.admitted = true
	return evict, true
}

// disconnect releases a connection (once: closing it again is a no-op).
func (a *admission) disconnect(c *clientConn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if c.admitted {
		a.dropLocked(c)
	}
}

func (a *admission) dropLocked(c *clientConn) {
	a.unwaitLocked(c)
	c.admitted = false
	a.conns--
}

// wait records that c waits for a request (http.StateNew, StateIdle).
func (a *admission) wait(c *clientConn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !c.admitted {
		return
	}
	a.unwaitLocked(c)
	c.since = a.now()
	c.elem = a.waiting.PushBack(c)
}

// work records that c serves a request (http.StateActive) or is done.
func (a *admission) work(c *clientConn) {
	a.mu.Lock()
	a.unwaitLocked(c)
	a.mu.Unlock()
}

func (a *admission) unwaitLocked(c *clientConn) {
	if c.elem != nil {
		a.waiting.Remove(c.elem)
		c.elem = nil
	}
}

// Why a request was shed: the metric reason's suffix and the flag named in
// the answer.
type shedReason struct{ what, flag string }

var (
	shedTransit       = shedReason{"bodies", "--max-bodies-in-transit"}
	shedClientTransit = shedReason{"client_bodies", "--max-client-bodies-in-transit"}
	shedBytes         = shedReason{"bytes", "--max-buffered-bytes"}
	shedTurns         = shedReason{"turns", "--max-concurrent-turns"}
)

// startBody charges a body in transit from client k, or returns why not.
func (a *admission) startBody(k clientKey) (shedReason, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	switch {
	case a.transit >= a.lim.transit:
		return shedTransit, false
	case a.lim.clientTransit > 0 && a.byClient[k] >= a.lim.clientTransit:
		return shedClientTransit, false
	}
	a.transit++
	a.byClient[k]++
	return shedReason{}, true
}

// endBody releases a body in transit.
func (a *admission) endBody(k clientKey) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.transit--
	if n := a.byClient[k] - 1; n > 0 {
		a.byClient[k] = n
	} else {
		delete(a.byClient, k)
	}
}

// charge takes n bytes of the buffer budget, or reports false when they
// do not fit.
func (a *admission) charge(n int64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.bytes+n > a.lim.bytes {
		return false
	}
	a.bytes += n
	return true
}

func (a *admission) release(n int64) {
	if n == 0 {
		return
	}
	a.mu.Lock()
	a.bytes -= n
	a.mu.Unlock()
}

// enter admits one turn, or reports false at --max-concurrent-turns.
func (a *admission) enter() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.turns >= a.lim.turns {
		return false
	}
	a.turns++
	return true
}

func (a *admission) leave() {
	a.mu.Lock()
	a.turns--
	a.mu.Unlock()
}

// held is what the admission holds now, for the metrics.
type held struct {
	conns, waiting, transit, turns int
	bytes                          int64
	evicted, refused               int64
}

func (a *admission) held() held {
	a.mu.Lock()
	defer a.mu.Unlock()
	return held{conns: a.conns, waiting: a.waiting.Len(), transit: a.transit, turns: a.turns,
		bytes: a.bytes, evicted: a.evicted, refused: a.refused}
}
