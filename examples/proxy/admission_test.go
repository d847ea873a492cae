package main

import (
	"net"
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
	a.work(c1) // c1 serves a request: never evicted
	a.wait(c2) // c2 waits again, from now: c3 has waited longest
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

	for _, k := range []clientKey{v4, mapped} {
		_, ok := a.startBody(k)
		require.True(t, ok)
	}
	why, ok := a.startBody(v4)
	assert.False(t, ok)
	assert.Equal(t, shedClientTransit, why)
	for _, k := range []clientKey{six1, other} {
		_, ok := a.startBody(k)
		require.True(t, ok)
	}
	why, ok = a.startBody(six2)
	assert.False(t, ok)
	assert.Equal(t, shedTransit, why)
	a.endBody(v4)
	_, ok = a.startBody(six2)
	assert.True(t, ok)
	for _, k := range []clientKey{mapped, six1, six2, other} {
		a.endBody(k)
	}
	assert.Equal(t, 0, a.held().transit)
	assert.Empty(t, a.byClient)
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
