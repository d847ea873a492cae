// Package bufpool keeps byte buffers and token id slices for reuse, by size
// class, so that a turn does not allocate its largest buffers.
package bufpool

import (
	"errors"
	"io"
	"math/bits"
	"sync"
	"unsafe"
)

// Bytes keeps byte buffers for reuse, by size class: class k holds
// buffers of capacity minPooled<<k. A Router owns one; request bodies read
// by ServeHTTP, render answers (held until D's first stream event, whose
// prompt ids are compared with the answer's text), decode stream buffers,
// a stream's decode handle, and the fingerprint, store entry and expanded
// handle of a turn come from it, so that a turn does not allocate its
// largest buffers. Buffers are held only while a turn uses them (at most
// one set per turn in flight); sync.Pool drops idle ones at GC.
type Bytes struct {
	classPool[byte]
}

// ErrTooLarge is Read's error for a body over its limit.
var ErrTooLarge = errors.New("body exceeds the size limit")

const (
	MinPooled   = 4 << 10
	poolClasses = 12 // up to 8 MiB
)

// class returns the size class that holds n bytes, or -1 when n is larger
// than the largest.
func class(n int) int {
	if n <= MinPooled {
		return 0
	}
	k := bits.Len(uint((n - 1) / MinPooled))
	if k >= poolClasses {
		return -1
	}
	return k
}

// classPool keeps slices of T by size class: class k holds slices of
// minPooled<<k bytes' capacity.
type classPool[T elem] struct {
	classes [poolClasses]sync.Pool
	boxes   sync.Pool  // empty *[]T, so that put does not allocate one
	check   checker[T] // Checked builds only
}

// elems is the capacity, in elements, of class k's slices.
func (p *classPool[T]) elems(k int) int {
	var t T
	return (MinPooled << k) / int(unsafe.Sizeof(t))
}

// classOf returns the class of slices with room for n elements, or -1
// when none is large enough.
func (p *classPool[T]) classOf(n int) int {
	var t T
	return class(n * int(unsafe.Sizeof(t)))
}

// take returns an empty slice of class k's capacity (k -1: made with
// room for n elements).
func (p *classPool[T]) take(k, n int) []T {
	var s []T
	switch v, ok := p.pooled(k); {
	case ok:
		s = v
	case k < 0:
		s = make([]T, 0, n)
	default:
		s = make([]T, 0, p.elems(k))
	}
	if Checked {
		p.check.got(s)
	}
	return s
}

// pooled returns a slice of class k from the pool, if it has one.
func (p *classPool[T]) pooled(k int) ([]T, bool) {
	if k < 0 {
		return nil, false
	}
	v, ok := p.classes[k].Get().(*[]T)
	if !ok {
		return nil, false
	}
	s := (*v)[:0]
	*v = nil
	p.boxes.Put(v)
	return s, true
}

// Put returns s to the pool; a slice of another capacity than a class's
// is dropped. Exactly one owner puts a buffer back, once, after its last
// reader (see Checked).
func (p *classPool[T]) Put(s []T) {
	if Checked {
		for _, b := range p.check.put(s) {
			p.put(b)
		}
		return
	}
	p.put(s)
}

// put pools s if it is of a class's capacity.
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

// Get returns a buffer of length n.
func (p *Bytes) Get(n int) []byte {
	return p.take(class(n), n)[:n]
}

// Read reads r to its end, at most limit bytes (errBodyTooLarge beyond),
// into a pooled buffer grown through the pool's classes, so that a body of
// unknown length (a chunked answer) does not allocate as io.ReadAll's
// doubling does. The caller puts the result back when done with it.
// It starts with a buffer of hint bytes (the size the last such body
// needed).
func (p *Bytes) Read(r io.Reader, limit int64, hint int) ([]byte, error) {
	b := p.Get(max(hint, MinPooled))[:0]
	for {
		if len(b) == cap(b) {
			if int64(len(b)) > limit {
				p.Put(b)
				return nil, ErrTooLarge
			}
			nb := p.Get(2 * cap(b))[:len(b)]
			copy(nb, b)
			p.Put(b)
			b = nb
		}
		n, err := r.Read(b[len(b):cap(b)])
		b = b[:len(b)+n]
		if int64(len(b)) > limit {
			p.Put(b)
			return nil, ErrTooLarge
		}
		if err == io.EOF {
			return b, nil
		}
		if err != nil {
			p.Put(b)
			return nil, err
		}
	}
}

// IDs keeps token id slices (render answers, streams' prompt ids) for
// reuse, by size class as bufPool (class k: minPooled<<k bytes of ids), so
// that prompts of different lengths (a 10 KB and a 100 KB conversation)
// each find their own instead of popping one another's.
type IDs struct {
	classPool[uint32]
}

// Get returns an empty slice with room for n ids: a class's capacity, at
// least a quarter more than n (the next turn of a conversation has a longer
// prompt, and should still fit in the slice this one returns).
func (p *IDs) Get(n int) []uint32 {
	n += n / 4
	return p.take(p.classOf(n), n)
}

// SameArray reports whether a and b share their first element's place
// (one slice's array), for slices with room.
func SameArray(a, b []uint32) bool {
	return cap(a) > 0 && cap(b) > 0 && &a[:1][0] == &b[:1][0]
}
