//go:build bidikv_bufcheck

package bufpool

import (
	"bytes"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// In a checked build every fault of ownership is loud: a second release
// panics, a read after release sees poison, a write after release panics
// when the buffer leaves the quarantine, and the pool never hands out a
// buffer twice.
func TestCheckedOwnership(t *testing.T) {
	require.True(t, Checked)
	t.Run("released twice", func(t *testing.T) {
		var p Bytes
		b := p.Get(100)
		p.Put(b)
		assert.PanicsWithValue(t, "bufpool: a buffer of 4096 elements released twice", func() { p.Put(b) })
	})
	t.Run("read after release sees poison", func(t *testing.T) {
		var p Bytes
		b := p.Get(5)
		copy(b, "hello")
		p.Put(b)
		assert.Equal(t, bytes.Repeat([]byte{0xDB}, 5), b)
		var q IDs
		ids := append(q.Get(3), 1, 2, 3)
		q.Put(ids)
		assert.Equal(t, []uint32{0xDBDBDBDB, 0xDBDBDBDB, 0xDBDBDBDB}, ids)
	})
	t.Run("write after release", func(t *testing.T) {
		var p Bytes
		b := p.Get(10)
		p.Put(b)
		b[3] = 'x' // a reader that kept b writes to it
		assert.PanicsWithValue(t, "bufpool: a buffer of 4096 elements written after its release (element 3)", func() {
			for range quarantineSize {
				p.Put(p.Get(10))
			}
		})
	})
	t.Run("released twice after the quarantine", func(t *testing.T) {
		var p Bytes
		b := p.Get(10)
		p.Put(b)
		for range quarantineSize {
			p.Put(make([]byte, 10)) // adopted buffers push b out
		}
		assert.Panics(t, func() { p.Put(b) })
	})
	t.Run("never handed out twice", func(t *testing.T) {
		var p Bytes
		seen := map[*byte]bool{}
		var held [][]byte
		for i := range 4 * quarantineSize {
			b := p.Get(4096)
			require.False(t, seen[&b[0]], "buffer %d handed out while held", i)
			seen[&b[0]] = true
			held = append(held, b)
			if i%3 == 0 {
				delete(seen, &held[0][0])
				p.Put(held[0])
				held = held[1:]
			}
		}
	})
	t.Run("buffers left to the collector are forgotten", func(t *testing.T) {
		var p Bytes
		for range 5000 {
			_ = p.Get(10) // never put back
			if len(p.check.states) > 2100 {
				runtime.GC()
			}
		}
		assert.Less(t, len(p.check.states), 5000)
	})
}
