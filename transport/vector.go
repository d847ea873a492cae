package transport

import (
	"context"
	"io"
	"net"
	"sync/atomic"
)

// Buffers is a request body made of pieces sent in order without being
// joined: an upstream request whose Body is a *Buffers is written to a
// connection of NewTransport with one vectored write (writev) of the
// pieces, where net/http would copy the body through a buffer of its own.
// It is an io.ReadCloser, so http.NewRequest keeps it as the Body. The
// pieces must not change until the request is done; Read consumes them.
type Buffers struct {
	bufs    net.Buffers
	n       int
	onClose func()
	closed  atomic.Bool
	inline  [inlinePieces][]byte // bufs for a body of few pieces
}

// inlinePieces is how many pieces a Buffers holds without a slice of its
// own.
const inlinePieces = 24

// NewBuffers returns a body of the pieces (the slice is copied, not the
// bytes). onClose, if not nil, is called once, by the first Close: net/http
// closes a request's body when it is done with it, even after RoundTrip
// returned, so that is when the pieces may be reused.
func NewBuffers(pieces [][]byte, onClose func()) *Buffers {
	b := &Buffers{onClose: onClose}
	if len(pieces) <= len(b.inline) {
		b.bufs = b.inline[:len(pieces):len(pieces)]
	} else {
		b.bufs = make(net.Buffers, len(pieces))
	}
	copy(b.bufs, pieces)
	for _, p := range pieces {
		b.n += len(p)
	}
	return b
}

// Len returns the number of bytes not yet read.
func (b *Buffers) Len() int { return b.n }

// Read reads the next bytes of the body.
func (b *Buffers) Read(p []byte) (int, error) {
	n, err := b.bufs.Read(p)
	b.n -= n
	return n, err
}

// WriteTo writes the rest of the body to w, vectored when w is a network
// connection.
func (b *Buffers) WriteTo(w io.Writer) (int64, error) {
	if vc, ok := w.(*vectorConn); ok {
		w = vc.Conn
	}
	n, err := b.bufs.WriteTo(w)
	b.n -= int(n)
	return n, err
}

// Close implements io.Closer: the first call runs the onClose function.
func (b *Buffers) Close() error {
	if !b.closed.Swap(true) && b.onClose != nil {
		b.onClose()
	}
	return nil
}

// vectorConn is a connection of NewTransport. net/http writes a request
// body of known length by handing the connection an io.LimitedReader of it
// (after the headers and the body's first bytes went through its bufio
// buffer); vectorConn writes a *Buffers behind it with one writev instead
// of the generic copy, which allocates a buffer of up to 32 KiB per
// request.
type vectorConn struct {
	net.Conn
}

// ReadFrom implements io.ReaderFrom.
func (c *vectorConn) ReadFrom(r io.Reader) (int64, error) {
	if lr, ok := r.(*io.LimitedReader); ok {
		if b, ok := lr.R.(*Buffers); ok && int64(b.Len()) <= lr.N {
			n, err := b.WriteTo(c.Conn)
			lr.N -= n
			return n, err
		}
	}
	if rf, ok := c.Conn.(io.ReaderFrom); ok {
		return rf.ReadFrom(r)
	}
	return io.Copy(struct{ io.Writer }{c.Conn}, r)
}

// vectorDial wraps the connections dial returns in vectorConn.
func vectorDial(dial func(ctx context.Context, network, addr string) (net.Conn, error)) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		c, err := dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		return &vectorConn{Conn: c}, nil
	}
}
