package main

import (
	"container/list"
	"context"
	"net"
	"net/netip"
	"sync"
	"sync/atomic"
	"time"
)

// retryAfterSeconds is the Retry-After of a shed request: admitted turns
// are expected to free room within about this long.
const retryAfterSeconds = 1

// evictAfter is how long a connection must have waited for a request
// before a new connection may close it at --max-connections: a client that
// has just connected is sending its request. The rule is exact: at the
// new connection's accept, by the admission's clock (monotonic), the
// waiting connection has waited at least evictAfter since its own accept
// (it has sent nothing) or since the start of the write of the last bytes
// of its last answer (it is idle between requests), inclusive. That write
// starts before its client can read them, so a client that waits
// evictAfter after reading its answer has always waited that long here.
const evictAfter = time.Second

// bodyRateGrace is how long a body is in transit before its rate is
// judged against --min-body-rate: time for its first bytes to arrive.
const bodyRateGrace = time.Second

// limits are the bounds the admission enforces, from the command line.
type limits struct {
	conns         int   // --max-connections
	transit       int   // --max-bodies-in-transit
	clientTransit int   // --max-client-bodies-in-transit, 0: no bound per client
	turns         int   // --max-concurrent-turns
	bytes         int64 // --max-buffered-bytes
	minBodyRate   int64 // --min-body-rate, bytes per second; 0: no body is cut for its rate
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
//     --max-client-bodies-in-transit takes the slot of the slowest body
//     in transit below --min-body-rate (that body is cut and answered
//     408), and gets 503 with Retry-After when there is none;
//   - a byte above --max-buffered-bytes (request bodies and the decode
//     answers the router holds, answer.go) or a complete body above
//     --max-concurrent-turns gets 503 with Retry-After in the API's
//     error shape (admit.go).
//
// A body in transit holds no turn, and a body slower than --min-body-rate
// gives its slot up to a new one: clients that trickle their bodies shed
// neither the clients whose bodies are in nor those whose bodies arrive
// at the minimum rate.
type admission struct {
	lim   limits
	now   func() time.Time
	epoch time.Time // when the admission was made: writes are stamped from it

	mu       sync.Mutex
	conns    int
	waiting  list.List // of *clientConn waiting for a request, longest waiting first
	bodies   map[*transitBody]struct{}
	byClient map[clientKey]int // bodies in transit per client address
	turns    int
	bytes    int64 // request bodies' and answers' bytes held
	answers  int64 // of which the decode answers'
	peak     int64 // the most bytes held at once
	evicted  int64 // connections closed at --max-connections
	refused  int64 // connections refused at --max-connections
	cut      int64 // bodies cut below --min-body-rate to admit a new one
}

func newAdmission(lim limits, now func() time.Time) *admission {
	if now == nil {
		now = time.Now
	}
	return &admission{lim: lim, now: now, epoch: now(), bodies: make(map[*transitBody]struct{}), byClient: make(map[clientKey]int)}
}

// transitBody is a request body in transit: charged to the admission from
// its start until it is in, ends, or is cut.
type transitBody struct {
	client clientKey
	n      atomic.Int64 // bytes received
	// stop ends the body's reads at once (its connection's read deadline
	// set in the past); called with the admission's lock held, so that a
	// body that has ended its transit is never stopped.
	stop func()

	start time.Time   // guarded by the admission's lock
	gone  atomic.Bool // cut to admit another body: its reads fail
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
	now := a.now()
	if a.conns >= a.lim.conns {
		e := a.waiting.Front()
		if e == nil || now.Sub(e.Value.(*clientConn).since) < evictAfter {
			a.refused++
			return nil, false
		}
		evict = e.Value.(*clientConn)
		a.dropLocked(evict)
		a.evicted++
	}
	a.conns++
	c.admitted = true
	c.accepted = now
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

// wait records that c waits for a request (http.StateNew, StateIdle):
// since its accept, or since the last write of its last answer
// (clientConn.Write), in the waiting list by that time.
func (a *admission) wait(c *clientConn) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !c.admitted {
		return
	}
	a.unwaitLocked(c)
	c.since = c.accepted
	if w := c.lastWrite.Load(); w != 0 {
		c.since = a.epoch.Add(time.Duration(w))
	}
	e := a.waiting.Back()
	for e != nil && e.Value.(*clientConn).since.After(c.since) {
		e = e.Prev()
	}
	if e == nil {
		c.elem = a.waiting.PushFront(c)
	} else {
		c.elem = a.waiting.InsertAfter(c, e)
	}
}

// wrote records a write to c, at the admission's clock.
func (a *admission) wrote(c *clientConn) {
	c.lastWrite.Store(int64(max(a.now().Sub(a.epoch), 1)))
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
	shedAnswerBytes   = shedReason{"answer_bytes", "--max-buffered-bytes"}
)

// startBody charges b, a body in transit from b.client, or returns why
// not. At a bound (all addresses', or b's address's) it cuts the slowest
// body in transit under that bound whose rate is below --min-body-rate
// and takes its slot; with none, b is refused.
func (a *admission) startBody(b *transitBody) (shedReason, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	now := a.now()
	if a.lim.clientTransit > 0 && a.byClient[b.client] >= a.lim.clientTransit {
		v := a.slowestLocked(now, b.client, true)
		if v == nil {
			return shedClientTransit, false
		}
		a.cutLocked(v)
	}
	if len(a.bodies) >= a.lim.transit {
		v := a.slowestLocked(now, clientKey{}, false)
		if v == nil {
			return shedTransit, false
		}
		a.cutLocked(v)
	}
	b.start = now
	a.bodies[b] = struct{}{}
	a.byClient[b.client]++
	return shedReason{}, true
}

// slowestLocked returns the body in transit (from client k only, if
// byClient) with the lowest rate among those below --min-body-rate: in
// transit for at least bodyRateGrace, with fewer bytes received than
// --min-body-rate × the time since its start. Nil when there is none.
func (a *admission) slowestLocked(now time.Time, k clientKey, byClient bool) *transitBody {
	if a.lim.minBodyRate <= 0 {
		return nil
	}
	var slowest *transitBody
	var slowestRate float64
	for b := range a.bodies {
		age := now.Sub(b.start)
		if (byClient && b.client != k) || age < bodyRateGrace {
			continue
		}
		rate := float64(b.n.Load()) / age.Seconds()
		if rate >= float64(a.lim.minBodyRate) {
			continue
		}
		if slowest == nil || rate < slowestRate {
			slowest, slowestRate = b, rate
		}
	}
	return slowest
}

// cutLocked ends b's transit and stops its reads: its request is answered
// 408 (admit.go).
func (a *admission) cutLocked(b *transitBody) {
	a.dropBodyLocked(b)
	b.gone.Store(true)
	a.cut++
	if b.stop != nil {
		b.stop()
	}
}

// endBody releases a body in transit, unless it was cut (already
// released).
func (a *admission) endBody(b *transitBody) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.bodies[b]; ok {
		a.dropBodyLocked(b)
	}
}

func (a *admission) dropBodyLocked(b *transitBody) {
	delete(a.bodies, b)
	if n := a.byClient[b.client] - 1; n > 0 {
		a.byClient[b.client] = n
	} else {
		delete(a.byClient, b.client)
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
	a.peak = max(a.peak, a.bytes)
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

// chargeAnswer is the router's WithLimits ChargeAnswer: the bytes of the
// decode answers the router holds (non-streaming answers, buffered
// streams) take the budget of --max-buffered-bytes with request bodies;
// n < 0 gives them back. A charge that does not fit marks the turn of ctx
// (admit.go), whose answer becomes the proxy's 503.
func (a *admission) chargeAnswer(ctx context.Context, n int64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if n > 0 && a.bytes+n > a.lim.bytes {
		if st, ok := ctx.Value(admittedKey{}).(*admitted); ok {
			st.answerShed.Store(true)
		}
		return false
	}
	a.bytes += n
	a.answers += n
	a.peak = max(a.peak, a.bytes)
	return true
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
	bytes, answers, peak           int64
	evicted, refused, cut          int64
}

func (a *admission) held() held {
	a.mu.Lock()
	defer a.mu.Unlock()
	return held{conns: a.conns, waiting: a.waiting.Len(), transit: len(a.bodies), turns: a.turns,
		bytes: a.bytes, answers: a.answers, peak: a.peak, evicted: a.evicted, refused: a.refused, cut: a.cut}
}
