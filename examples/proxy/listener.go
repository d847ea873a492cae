package main

import (
	"bufio"
	"bytes"
	"container/list"
	"context"
	"io"
	"net"
	"net/http"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
)

// Refusals at --max-connections: each is answered by a goroutine that reads
// the request line (to pick the error shape), writes 503 and lingers until
// the client closes, within refuseWait. At most maxRefusing run at once;
// beyond, a refused connection is closed without an answer.
const (
	refuseWait  = 500 * time.Millisecond
	maxRefusing = 64
)

// clientConn is an accepted client connection charged to the admission
// until it is closed. It counts the bytes written to it, for the
// unacknowledged-bytes bound (stall.go).
type clientConn struct {
	net.Conn
	adm     *admission
	client  clientKey
	raw     syscall.RawConn // the socket, for sendQueue; nil: none
	written atomic.Int64
	outq    struct { // sendQueue's ioctl, made once
		fn    func(fd uintptr)
		n     int32
		errno syscall.Errno
	}
	closed atomic.Bool
	// heads scans what the connection reads for a head with both
	// Content-Length and Transfer-Encoding (framing.go); Reads are never
	// concurrent. amb is its finding.
	heads headerScan
	amb   atomic.Bool

	// lastWrite is when the last write to it was made, from the
	// admission's epoch (0: none yet).
	lastWrite atomic.Int64

	// Guarded by adm.mu.
	admitted bool          // charged to the admission
	elem     *list.Element // in adm.waiting while waiting for a request
	accepted time.Time     // when it was accepted
	since    time.Time     // when it started waiting: accepted, or its last write
}

func (c *clientConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if !c.heads.ambiguous {
		c.heads.scan(p[:n])
		if c.heads.ambiguous {
			c.amb.Store(true)
		}
	}
	return n, err
}

// ambiguous reports whether the connection read a head with both
// Content-Length and Transfer-Encoding.
func (c *clientConn) ambiguous() bool { return c.amb.Load() }

// Write writes to the client. The write is stamped before it starts, so
// that the stamp is never later than the moment the client can read its
// last byte (a stamp after the write could come, on a loaded machine,
// after the client read the answer and started its wait): a connection
// counts as waiting only between requests, once its answer is written
// whole, so a write still blocked is never judged idle by its stamp.
func (c *clientConn) Write(p []byte) (int, error) {
	c.adm.wrote(c)
	n, err := c.Conn.Write(p)
	c.written.Add(int64(n))
	return n, err
}

// Close releases the connection's charge, then closes it: by the time its
// client sees it closed, its slot under --max-connections is free.
func (c *clientConn) Close() error {
	if !c.closed.Swap(true) {
		c.adm.disconnect(c)
	}
	return c.Conn.Close()
}

// CloseWrite lets net/http half-close after a 431, as on a plain TCP
// connection.
func (c *clientConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return nil
}

// clientConnOf returns the clientConn under a connection the server was
// given (nil for another).
func clientConnOf(c net.Conn) *clientConn {
	if jc, ok := c.(*jsonErrorConn); ok {
		c = jc.Conn
	}
	cc, _ := c.(*clientConn)
	return cc
}

// connKey is the request context key of the request's *clientConn.
type connKey struct{}

// connContext is the server's ConnContext: requests find their connection.
func connContext(ctx context.Context, c net.Conn) context.Context {
	if cc := clientConnOf(c); cc != nil {
		return context.WithValue(ctx, connKey{}, cc)
	}
	return ctx
}

// connFrom returns the request's connection, nil when it has none.
func connFrom(ctx context.Context) *clientConn {
	cc, _ := ctx.Value(connKey{}).(*clientConn)
	return cc
}

// connState is the server's ConnState: the admission learns which
// connections wait for a request, the ones it may close at the cap.
func (a *admission) connState(c net.Conn, st http.ConnState) {
	cc := clientConnOf(c)
	if cc == nil {
		return
	}
	switch st {
	case http.StateNew, http.StateIdle:
		a.wait(cc)
	default:
		a.work(cc)
	}
}

// admitListener charges every accepted connection to the admission, and
// refuses those above --max-connections. Connections it returns rewrite
// net/http's plain-text errors to JSON (jsonErrorConn).
type admitListener struct {
	net.Listener
	adm      *admission
	refusing chan struct{} // one element per refusal being answered
	wg       sync.WaitGroup
}

func newAdmitListener(ln net.Listener, adm *admission) *admitListener {
	return &admitListener{Listener: ln, adm: adm, refusing: make(chan struct{}, maxRefusing)}
}

func (l *admitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		cc := &clientConn{Conn: c, adm: l.adm, client: clientKeyOf(c.RemoteAddr())}
		if sc, ok := c.(syscall.Conn); ok {
			cc.raw, _ = sc.SyscallConn()
		}
		evict, ok := l.adm.connect(cc)
		if evict != nil {
			// Already released; its server goroutine sees the close.
			evict.closed.Store(true)
			_ = evict.Conn.Close()
		}
		if ok {
			return &jsonErrorConn{Conn: cc}, nil
		}
		l.refuse(c)
	}
}

// Close closes the listener and waits for the refusals being answered.
func (l *admitListener) Close() error {
	err := l.Listener.Close()
	l.wg.Wait()
	return err
}

// refuse answers a connection above --max-connections with 503 and closes
// it, on a goroutine of its own (bounded by maxRefusing).
func (l *admitListener) refuse(c net.Conn) {
	select {
	case l.refusing <- struct{}{}:
	default:
		_ = c.Close()
		return
	}
	l.wg.Add(1)
	go func() {
		defer func() { <-l.refusing; l.wg.Done() }()
		refuseConn(c, refuseWait)
	}()
}

// refuseConn writes 503 with Retry-After on c, in the error shape of the
// API of the request line when it arrives within wait (OpenAI's otherwise),
// then closes c once the client has (or wait is over): closing with unread
// request bytes would reset the connection and could lose the answer.
func refuseConn(c net.Conn, wait time.Duration) {
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(wait))
	var path []byte
	br := bufio.NewReaderSize(c, 4096)
	if line, err := br.ReadSlice('\n'); err == nil {
		if f := bytes.Fields(line); len(f) == 3 {
			path, _, _ = bytes.Cut(f[1], []byte("?"))
		}
	}
	_ = c.SetDeadline(time.Now().Add(wait))
	_, _ = c.Write(refusal(string(path)))
	if cw, ok := c.(interface{ CloseWrite() error }); ok {
		_ = cw.CloseWrite()
	}
	_, _ = io.Copy(io.Discard, br)
}

// refusal is the raw answer to a connection above --max-connections.
func refusal(path string) []byte {
	b := proxyError(path, http.StatusServiceUnavailable,
		"overloaded: --max-connections reached; retry later", "server_error", "overloaded")
	out := make([]byte, 0, len(b)+160)
	out = append(out, "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nRetry-After: "...)
	out = strconv.AppendInt(out, retryAfterSeconds, 10)
	out = append(out, "\r\nConnection: close\r\nContent-Length: "...)
	out = strconv.AppendInt(out, int64(len(b)), 10)
	out = append(out, "\r\n\r\n"...)
	return append(out, b...)
}
