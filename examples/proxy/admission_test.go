package main

import (
	"bufio"
	"net"
	"net/http"
	"net/netip"
	"runtime"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// The connection ledger: at the cap, the connection that has waited
// longest for a request is closed once it has waited evictAfter; one
// serving a request never is; a new one is refused otherwise; and every
// connection is released exactly once, evicted or closed.
func TestAdmissionConnections(t *testing.T) {
	now := time.Unix(1000, 0)
	a := newAdmission(limits{conns: 3, transit: 1, turns: 1, bytes: 1}, func() time.Time { return now })
	conn := func() *clientConn { return &clientConn{adm: a} }
	c1, c2, c3 := conn(), conn(), conn()
	for _, c := range []*clientConn{c1, c2, c3} {
		ev, ok := a.connect(c)
		require.True(t, ok)
		require.Nil(t, ev)
		a.wait(c)
		now = now.Add(time.Millisecond)
	}
	a.work(c1)  // c1 serves a request: never evicted
	a.work(c2)  // c2 answers a request and waits again, from its answer's
	a.wrote(c2) // last write: c3 has waited longest
	a.wait(c2)
	ev, ok := a.connect(conn())
	assert.False(t, ok, "no connection has waited evictAfter")
	assert.Nil(t, ev)

	now = now.Add(evictAfter)
	c4 := conn()
	ev, ok = a.connect(c4)
	require.True(t, ok)
	assert.Same(t, c3, ev, "the one that waited longest")
	a.disconnect(c3) // its close, later: already released
	a.wait(c4)

	now = now.Add(evictAfter)
	ev, ok = a.connect(conn())
	require.True(t, ok)
	assert.Same(t, c2, ev)
	a.work(c4)
	_, ok = a.connect(conn())
	assert.False(t, ok, "every connection serves a request")

	h := a.held()
	assert.Equal(t, held{conns: 3, waiting: 0, evicted: 2, refused: 2}, h)
	a.disconnect(c1)
	a.disconnect(c1)
	assert.Equal(t, 2, a.held().conns, "released once")
}

// The eviction rule is exact, by the admission's clock: a connection that
// has sent nothing is evictable evictAfter after its accept, however late
// net/http reports it new; an idle one evictAfter after the last write of
// its answer, however late net/http reports it idle; at evictAfter less a
// nanosecond it is not.
func TestEvictionExact(t *testing.T) {
	t0 := time.Unix(1000, 0)
	now := t0
	a := newAdmission(limits{conns: 1, transit: 1, turns: 1, bytes: 1}, func() time.Time { return now })
	c := &clientConn{adm: a}
	_, ok := a.connect(c) // accepted at t0
	require.True(t, ok)
	now = now.Add(30 * time.Millisecond)
	a.wait(c) // http.StateNew, reported late
	now = t0.Add(evictAfter - time.Nanosecond)
	_, ok = a.connect(&clientConn{adm: a})
	assert.False(t, ok, "a nanosecond short")
	now = t0.Add(evictAfter)
	c2 := &clientConn{adm: a}
	ev, ok := a.connect(c2)
	require.True(t, ok, "waited exactly evictAfter since its accept")
	assert.Same(t, c, ev)

	// c2 serves a request; its answer's last byte is written at t1 and
	// net/http reports it idle 30 ms later.
	a.work(c2)
	t1 := now.Add(time.Second)
	now = t1
	a.wrote(c2)
	now = now.Add(30 * time.Millisecond)
	a.wait(c2)
	now = t1.Add(evictAfter - time.Nanosecond)
	_, ok = a.connect(&clientConn{adm: a})
	assert.False(t, ok, "a nanosecond short")
	now = t1.Add(evictAfter)
	ev, ok = a.connect(&clientConn{adm: a})
	require.True(t, ok, "idle exactly evictAfter since its answer's last write")
	assert.Same(t, c2, ev)
}

// Bodies in transit are bounded in all and per client address, an IPv6
// client by its /64 and an IPv4-mapped address as its IPv4 one.
func TestAdmissionBodiesInTransit(t *testing.T) {
	a := newAdmission(limits{conns: 1, transit: 4, clientTransit: 2, turns: 1, bytes: 1}, nil)
	key := func(s string) clientKey {
		ap, err := net.ResolveTCPAddr("tcp", s)
		require.NoError(t, err)
		return clientKeyOf(ap)
	}
	v4, mapped := key("192.0.2.1:1000"), key("[::ffff:192.0.2.1]:2000")
	assert.Equal(t, v4, mapped)
	six1, six2, other := key("[2001:db8:1:2::1]:1"), key("[2001:db8:1:2:ffff::9]:2"), key("[2001:db8:1:3::1]:3")
	assert.Equal(t, six1, six2, "one /64")
	assert.NotEqual(t, six1, other)

	body := func(k clientKey) *transitBody { return &transitBody{client: k} }
	b1, b2 := body(v4), body(mapped)
	for _, b := range []*transitBody{b1, b2} {
		_, ok := a.startBody(b)
		require.True(t, ok)
	}
	why, ok := a.startBody(body(v4))
	assert.False(t, ok)
	assert.Equal(t, shedClientTransit, why)
	b3, b4 := body(six1), body(other)
	for _, b := range []*transitBody{b3, b4} {
		_, ok := a.startBody(b)
		require.True(t, ok)
	}
	why, ok = a.startBody(body(six2))
	assert.False(t, ok)
	assert.Equal(t, shedTransit, why)
	a.endBody(b1)
	a.endBody(b1) // once
	b5 := body(six2)
	_, ok = a.startBody(b5)
	assert.True(t, ok)
	for _, b := range []*transitBody{b2, b3, b4, b5} {
		a.endBody(b)
	}
	assert.Equal(t, 0, a.held().transit)
	assert.Empty(t, a.byClient)
}

// At a bound of bodies in transit, a new body takes the slot of the
// slowest body under that bound whose rate, after bodyRateGrace, is below
// --min-body-rate; that body's reads are stopped once. A body at the rate,
// or younger than the grace, keeps its slot, and the new body is refused.
func TestAdmissionCutsSlowestBody(t *testing.T) {
	now := time.Unix(1000, 0)
	clock := func() time.Time { return now }
	a := newAdmission(limits{conns: 1, transit: 3, clientTransit: 2, turns: 1, bytes: 1, minBodyRate: 1000}, clock)
	stopped := map[*transitBody]int{}
	body := func(k byte) *transitBody {
		b := &transitBody{client: clientKey(netip.AddrFrom4([4]byte{127, 0, 0, k}))}
		b.stop = func() { stopped[b]++ }
		return b
	}
	fast, slow, slower := body(1), body(2), body(3)
	for _, b := range []*transitBody{fast, slow, slower} {
		_, ok := a.startBody(b)
		require.True(t, ok)
	}
	// Within the grace, every body keeps its slot.
	now = now.Add(bodyRateGrace - time.Millisecond)
	_, ok := a.startBody(body(4))
	assert.False(t, ok, "no body has been in transit for the grace")

	now = now.Add(time.Millisecond) // 1 s: the rate needs 1000 bytes
	fast.n.Store(1000)              // exactly the rate: kept
	slow.n.Store(999)
	slower.n.Store(10)
	b4 := body(4)
	_, ok = a.startBody(b4)
	require.True(t, ok)
	assert.True(t, slower.gone.Load(), "the slowest body is cut")
	assert.Equal(t, 1, stopped[slower])
	assert.False(t, slow.gone.Load())
	a.endBody(slower) // its handler ends later: already released
	assert.Equal(t, 3, a.held().transit)

	b5 := body(5)
	_, ok = a.startBody(b5)
	require.True(t, ok)
	assert.True(t, slow.gone.Load())
	why, ok := a.startBody(body(6))
	assert.False(t, ok, "the other bodies are at the rate or in their grace")
	assert.Equal(t, shedTransit, why)

	// Per address: a body over its address's bound cuts only a body of
	// that address.
	a.endBody(b5)
	b7, b8 := body(1), body(1)
	_, ok = a.startBody(b7)
	require.True(t, ok)
	why, ok = a.startBody(b8)
	assert.False(t, ok, "127.0.0.1's bodies are at the rate or young")
	assert.Equal(t, shedClientTransit, why)
	now = now.Add(2 * bodyRateGrace)
	b7.n.Store(5000) // 2500 bytes/s
	_, ok = a.startBody(b8)
	require.True(t, ok)
	assert.True(t, fast.gone.Load(), "127.0.0.1's slowest (1000 bytes in 3 s)")
	assert.False(t, b7.gone.Load())
	assert.False(t, b4.gone.Load(), "another address's slower body is not cut for 127.0.0.1's bound")
	assert.Equal(t, int64(3), a.held().cut)
	for _, b := range []*transitBody{b4, b7, b8} {
		a.endBody(b)
	}
	assert.Equal(t, 0, a.held().transit)
	assert.Empty(t, a.byClient)

	// --min-body-rate 0: nothing is cut.
	a = newAdmission(limits{conns: 1, transit: 1, turns: 1, bytes: 1}, clock)
	first := body(1)
	_, ok = a.startBody(first)
	require.True(t, ok)
	now = now.Add(time.Hour)
	_, ok = a.startBody(body(2))
	assert.False(t, ok)
	assert.False(t, first.gone.Load())
}

// sendQueue reads a socket's unacknowledged bytes without allocating: it
// runs at every write of a stream.
func TestSendQueueAllocs(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("Linux only")
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer ln.Close()
	c, err := net.Dial("tcp", ln.Addr().String())
	require.NoError(t, err)
	defer c.Close()
	s, err := ln.Accept()
	require.NoError(t, err)
	defer s.Close()
	cc := &clientConn{Conn: s}
	cc.raw, err = s.(syscall.Conn).SyscallConn()
	require.NoError(t, err)
	q, ok := cc.sendQueue()
	require.True(t, ok)
	assert.Zero(t, q)
	assert.Zero(t, testing.AllocsPerRun(100, func() { _, _ = cc.sendQueue() }))
}

// Through the proxy: a client that waits exactly evictAfter after reading
// its answer finds its idle connection evictable by the next connection at
// --max-connections, every time.
func TestEvictionAfterExactWait(t *testing.T) {
	p := startInProcess(t, nil, "--max-connections", "1")
	for i := range 3 {
		idle := p.dial(t)
		_, err := idle.Write([]byte("GET /health HTTP/1.1\r\nHost: proxy\r\n\r\n"))
		require.NoError(t, err)
		br := bufio.NewReader(idle)
		resp, _ := rawResponse(t, br)
		require.Equal(t, http.StatusOK, resp.StatusCode)
		time.Sleep(evictAfter)
		next := p.dial(t)
		_, err = next.Write([]byte("GET /health HTTP/1.1\r\nHost: proxy\r\nConnection: close\r\n\r\n"))
		require.NoError(t, err)
		resp, body := rawResponse(t, bufio.NewReader(next))
		assert.Equal(t, http.StatusOK, resp.StatusCode, "round %d: %s", i, body)
		_, err = br.ReadByte()
		assert.Error(t, err, "round %d: the idle connection was closed", i)
		waitClosed(t, next, 5*time.Second)
	}
}
