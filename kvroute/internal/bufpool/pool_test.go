package bufpool

import (
	"io"
	"strings"
	"testing"
	"testing/iotest"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestIDPoolClasses hands out slices by size class: room for a quarter
// more than asked, a returned slice comes back for a request of its class
// and not for a longer prompt's, and slices of other capacities are
// dropped.
func TestIDPoolClasses(t *testing.T) {
	var p IDs
	small := p.Get(2600) // a 10 KB conversation's prompt
	assert.GreaterOrEqual(t, cap(small), 2600+2600/4)
	assert.Empty(t, small)
	large := p.Get(26000) // a 100 KB one's
	assert.GreaterOrEqual(t, cap(large), 26000+26000/4)
	p.Put(small[:10])
	p.Put(large)
	// sync.Pool may drop what it holds at any time (a GC), so only what
	// is handed out is checked, not that it is the same slice.
	got := p.Get(26000)
	assert.GreaterOrEqual(t, cap(got), 26000+26000/4, "a longer prompt never gets the small class's slice")
	got = p.Get(2600)
	assert.GreaterOrEqual(t, cap(got), 2600+2600/4)
	assert.Empty(t, got)
	p.Put(make([]uint32, 0, 3000)) // not a class's capacity: dropped, no panic
	p.Put(nil)
	huge := p.Get(4 << 20) // beyond the largest class: made to measure
	assert.Equal(t, (4<<20)+(4<<20)/4, cap(huge))
	assert.True(t, SameArray(large, large[:0]))
	assert.False(t, SameArray(large, got))
	assert.False(t, SameArray(nil, got))
}

func TestBufPoolClasses(t *testing.T) {
	for _, tt := range []struct{ n, class int }{{0, 0}, {1, 0}, {4096, 0}, {4097, 1}, {8192, 1}, {8193, 2}, {100 << 10, 5}, {8 << 20, 11}, {8<<20 + 1, -1}} {
		assert.Equal(t, tt.class, class(tt.n), "class(%d)", tt.n)
	}
	var p Bytes
	b := p.Get(5000)
	assert.Len(t, b, 5000)
	assert.Equal(t, 8192, cap(b))
	p.Put(make([]byte, 5000)) // not a class's capacity: dropped
	big := p.Get(9 << 20)
	assert.Len(t, big, 9<<20)
}

func TestBufPoolRead(t *testing.T) {
	var p Bytes
	for _, n := range []int{0, 10, MinPooled, MinPooled + 1, 100 << 10} {
		body := strings.Repeat("y", n)
		b, err := p.Read(iotestHalf(strings.NewReader(body)), 1<<20, n/2)
		require.NoError(t, err)
		assert.Equal(t, body, string(b))
		p.Put(b)
	}
	_, err := p.Read(strings.NewReader(strings.Repeat("z", 5000)), 4999, 0)
	assert.ErrorIs(t, err, ErrTooLarge)
	_, err = p.Read(strings.NewReader(strings.Repeat("z", 4096)), 4095, 0)
	assert.ErrorIs(t, err, ErrTooLarge)
	b, err := p.Read(strings.NewReader(strings.Repeat("z", 4096)), 4096, 0)
	require.NoError(t, err)
	assert.Len(t, b, 4096)
}

// iotestHalf reads half of what is asked each time.
func iotestHalf(r io.Reader) io.Reader { return iotest.HalfReader(r) }
