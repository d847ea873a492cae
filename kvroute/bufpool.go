package kvroute

import (
	"io"
	"math/bits"
	"sync"
	"sync/atomic"
	"unsafe"
)

// bufPool keeps byte buffers for reuse, by size class: class k holds
// buffers of capacity minPooled<<k. A Router owns one; request bodies read
// by ServeHTTP, render answers (held until D's first stream event, whose
// prompt ids are compared with the answer's text), decode stream buffers,
// a stream's decode handle, and the fingerprint, store entry and expanded
// handle of a turn come from it, so that a turn does not allocate its
// largest buffers. Buffers are held only while a turn uses them (at most
// one set per turn in flight); sync.Pool drops idle ones at GC.
type bufPool struct {
	classPool[byte]
}

const (
	minPooled   = 4 << 10
	poolClasses = 12 // up to 8 MiB
)

// class returns the size class that holds n bytes, or -1 when n is larger
// than the largest.
func class(n int) int {
	if n <= minPooled {
		return 0
	}
	k := bits.Len(uint((n - 1) / minPooled))
	if k >= poolClasses {
		return -1
	}
	return k
}

// classPool keeps slices of T by size class: class k holds slices of
// minPooled<<k bytes' capacity.
type classPool[T any] struct {
	classes [poolClasses]sync.Pool
	boxes   sync.Pool // empty *[]T, so that put does not allocate one
}

// elems is the capacity, in elements, of class k's slices.
func (p *classPool[T]) elems(k int) int {
	var t T
	return (minPooled << k) / int(unsafe.Sizeof(t))
}

// classOf returns the class of slices with room for n elements, or -1
// when none is large enough.
func (p *classPool[T]) classOf(n int) int {
	var t T
	return class(n * int(unsafe.Sizeof(t)))
}

// take returns an empty slice of class k's capacity.
func (p *classPool[T]) take(k int) []T {
	if v, ok := p.classes[k].Get().(*[]T); ok {
		s := (*v)[:0]
		*v = nil
		p.boxes.Put(v)
		return s
	}
	return make([]T, 0, p.elems(k))
}

// put returns s to the pool; a slice of another capacity than a class's
// is dropped.
func (p *classPool[T]) put(s []T) {
	k := p.classOf(cap(s))
	if k < 0 || cap(s) != p.elems(k) {
		return
	}
	v, _ := p.boxes.Get().(*[]T)
	if v == nil {
		v = new([]T)
	}
	*v = s[:0]
	p.classes[k].Put(v)
}

// get returns a buffer of length n.
func (p *bufPool) get(n int) []byte {
	k := class(n)
	if k < 0 {
		return make([]byte, n)
	}
	return p.take(k)[:n]
}

// bodyRef counts the users of a pooled request body: ServeHTTP, for the
// turn, and each upstream request body that aliases it, until net/http
// closes it. The last release returns the buffer to the pool. A nil
// *bodyRef (a body the router does not own) counts nothing.
type bodyRef struct {
	n    atomic.Int32
	buf  []byte
	pool *bufPool
	rel  func() // release, made once for every upstream body's onClose
}

func (b *bodyRef) acquire() {
	if b != nil {
		b.n.Add(1)
	}
}

func (b *bodyRef) release() {
	if b != nil && b.n.Add(-1) == 0 {
		b.pool.put(b.buf)
	}
}

// read reads r to its end, at most limit bytes (errBodyTooLarge beyond),
// into a pooled buffer grown through the pool's classes, so that a body of
// unknown length (a chunked answer) does not allocate as io.ReadAll's
// doubling does. The caller puts the result back when done with it.
// It starts with a buffer of hint bytes (the size the last such body
// needed).
func (p *bufPool) read(r io.Reader, limit int64, hint int) ([]byte, error) {
	b := p.get(max(hint, minPooled))[:0]
	for {
		if len(b) == cap(b) {
			if int64(len(b)) > limit {
				p.put(b)
				return nil, errBodyTooLarge
			}
			nb := p.get(2 * cap(b))[:len(b)]
			copy(nb, b)
			p.put(b)
			b = nb
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if int64(len(b)) > limit {
			p.put(b)
			return nil, errBodyTooLarge
		}
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			p.put(b)
			return nil, err
		}
	}
}

// idPool keeps token id slices (render answers, streams' prompt ids) for
// reuse, by size class as bufPool (class k: minPooled<<k bytes of ids), so
// that prompts of different lengths (a 10 KB and a 100 KB conversation)
// each find their own instead of popping one another's.
type idPool struct {
	classPool[uint32]
}

// get returns an empty slice with room for n ids: a class's capacity, at
// least a quarter more than n (the next turn of a conversation has a longer
// prompt, and should still fit in the slice this one returns).
func (p *idPool) get(n int) []uint32 {
	n += n / 4
	k := p.classOf(n)
	if k < 0 {
		return make([]uint32, 0, n)
	}
	return p.take(k)
}

// sameArray reports whether a and b share their first element's place
// (one slice's array), for slices with room.
func sameArray(a, b []uint32) bool {
	return cap(a) > 0 && cap(b) > 0 && &a[:1][0] == &b[:1][0]
}
