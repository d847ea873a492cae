package kvroute

import (
	"bytes"
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
)

func TestReadBody(t *testing.T) {
	var bufs bufpool.Bytes
	body := strings.Repeat("x", 1000)
	b, ref, err := readBody(strings.NewReader(body), 1000, 4096, &bufs)
	require.NoError(t, err)
	assert.Equal(t, body, string(b))
	assert.Equal(t, bufpool.MinPooled, cap(b), "one pooled buffer of the announced size's class")
	require.NotNil(t, ref)
	require.True(t, ref.hold()) // an upstream body aliasing it
	ref.release()               // the turn ends
	again := bufs.Get(1000)
	assert.NotSame(t, &b[0], &again[0], "still held by the upstream body")
	assert.Equal(t, int32(1), ref.n.Load())
	ref.release() // net/http closed the upstream body: back to the pool
	assert.Equal(t, int32(0), ref.n.Load())
	// A reader that asks for it now started too late: refused, never
	// handed the buffer the pool may have given another request.
	if bufpool.Checked {
		assert.Panics(t, func() { ref.hold() })
		assert.Panics(t, func() { ref.release() }, "released once more than held")
	} else {
		assert.False(t, ref.hold())
		_, err := legBody{b}.reader(ref)
		assert.ErrorIs(t, err, errBodyReleased)
	}

	_, _, err = readBody(strings.NewReader(body[:10]), 1000, 4096, &bufs)
	assert.ErrorIs(t, err, io.ErrUnexpectedEOF)

	_, _, err = readBody(strings.NewReader(body), 10, 4096, &bufs)
	assert.ErrorContains(t, err, "longer than its Content-Length")

	// Unknown length, or one over the limit: read as it comes (the
	// caller's MaxBytesReader enforces the limit), not pooled.
	b, ref, err = readBody(bytes.NewReader([]byte(body)), -1, 4096, &bufs)
	require.NoError(t, err)
	assert.Equal(t, body, string(b))
	assert.Nil(t, ref)
	ref.release() // a nil reference counts nothing
	b, _, err = readBody(bytes.NewReader([]byte(body)), 1<<20, 4096, &bufs)
	require.NoError(t, err)
	assert.Len(t, b, 1000)
}

// iotestHalf reads half of what is asked each time.
func iotestHalf(r io.Reader) io.Reader { return iotest.HalfReader(r) }

// A request body's buffer grows with what arrived: at most four times the
// bytes in, or firstBodyBuffer, for any declared length; and it ends at
// exactly the length.
func TestBodyBufferFollowsArrivals(t *testing.T) {
	for _, n := range []int{1, 100, firstBodyBuffer, firstBodyBuffer + 1, 100 << 10, 1 << 20, 18 << 20, 32<<20 - 1, 32 << 20} {
		cur, steps := min(n, firstBodyBuffer), 0
		for cur < n {
			next := nextBodyBuffer(cur, n)
			if next <= cur || next > n || next > 4*cur {
				t.Fatalf("length %d: a full buffer of %d grows to %d", n, cur, next)
			}
			cur = next
			steps++
		}
		if cur != n || steps > 10 {
			t.Fatalf("length %d: ends at %d after %d steps", n, cur, steps)
		}
	}
}
