package bufpool

import (
	"fmt"
	"sync"
	"unsafe"
	"weak"
)

// The ownership rules of a pooled buffer: whoever Gets it owns it, hands it
// over explicitly, and exactly one owner Puts it back, after its last
// reader. A buffer Put twice would be handed to two turns at once (one
// tenant's request body carrying another's bytes), and a buffer read or
// written after its Put corrupts whichever turn has it next. In a build
// with the bidikv_bufcheck tag (Checked; make test sets it) each pool keeps
// a checker that makes every such fault loud:
//
//   - a Put of a buffer that is already back (released twice) panics;
//   - a Put poisons the buffer (every byte 0xDB, every id 0xDBDBDBDB), so a
//     read after release sees poison, never another turn's data: a body
//     that no longer parses, a token id no engine has;
//   - the buffer then waits in a quarantine of quarantineSize buffers
//     before the pool may hand it out again, and a write after release
//     (poison changed) panics when it leaves the quarantine.
//
// Buffers that were never the pool's (a slice grown by append, adopted by
// Put) are poisoned and quarantined too. Without the tag none of this is
// compiled in.

// quarantineSize is how many released buffers each pool holds back, and
// quarantineBytes how many bytes of them at most.
const (
	quarantineSize  = 64
	quarantineBytes = 64 << 20
)

// elem is what the pools hold: bytes and token ids.
type elem interface{ byte | uint32 }

// state is what the checker knows of a buffer.
type state uint8

const (
	stateOut      state = iota + 1 // handed out by Get: its owner's
	stateReleased                  // Put, poisoned, in the quarantine
	statePooled                    // out of the quarantine, in the pool
)

// checker tracks the buffers of one classPool (Checked builds only). It
// holds weak pointers, so buffers left to the collector (a stream closed
// early keeps its buffers) are not kept alive.
type checker[T elem] struct {
	mu         sync.Mutex
	states     map[weak.Pointer[T]]state
	quarantine [][]T // oldest first
	held       int   // bytes in the quarantine
	prunedAt   int
}

// poison is the value a released buffer is filled with: 0xDB in every
// byte.
func poison[T elem]() T { return ^T(0) / 0xFF * 0xDB }

// key is s's identity: its array's first element.
func key[T elem](s []T) (weak.Pointer[T], bool) {
	if cap(s) == 0 {
		return weak.Pointer[T]{}, false
	}
	return weak.Make(unsafe.SliceData(s[:1])), true
}

// got records that Get handed s out.
func (c *checker[T]) got(s []T) {
	k, ok := key(s)
	if !ok {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.states == nil {
		c.states = map[weak.Pointer[T]]state{}
	}
	if c.states[k] == stateOut || c.states[k] == stateReleased {
		panic(fmt.Sprintf("bufpool: a buffer of %d elements handed out while it is still in use or in quarantine", cap(s)))
	}
	c.states[k] = stateOut
	c.prune()
}

// put records s's release, poisons it and quarantines it; it returns the
// buffers that leave the quarantine for the pool, checked for writes after
// their release.
func (c *checker[T]) put(s []T) [][]T {
	k, ok := key(s)
	if !ok {
		return nil
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.states == nil {
		c.states = map[weak.Pointer[T]]state{}
	}
	switch c.states[k] {
	case stateReleased, statePooled:
		panic(fmt.Sprintf("bufpool: a buffer of %d elements released twice", cap(s)))
	}
	c.states[k] = stateReleased
	full := s[:cap(s)]
	p := poison[T]()
	for i := range full {
		full[i] = p
	}
	c.quarantine = append(c.quarantine, full)
	c.held += len(full) * int(unsafe.Sizeof(p))
	var out [][]T
	for len(c.quarantine) > quarantineSize || (c.held > quarantineBytes && len(c.quarantine) > 1) {
		b := c.quarantine[0]
		c.quarantine[0] = nil
		c.quarantine = c.quarantine[1:]
		c.held -= len(b) * int(unsafe.Sizeof(p))
		for i := range b {
			if b[i] != p {
				panic(fmt.Sprintf("bufpool: a buffer of %d elements written after its release (element %d)", cap(b), i))
			}
		}
		if k, ok := key(b); ok {
			c.states[k] = statePooled
		}
		out = append(out, b)
	}
	return out
}

// prune forgets buffers the collector took, when the map has doubled
// since the last prune. c.mu held.
func (c *checker[T]) prune() {
	if len(c.states) < 2*max(c.prunedAt, 1024) {
		return
	}
	for k := range c.states {
		if k.Value() == nil {
			delete(c.states, k)
		}
	}
	c.prunedAt = len(c.states)
}
