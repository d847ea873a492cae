package kvroute

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// TestIDPoolClasses hands out slices by size class: room for a quarter
// more than asked, a returned slice comes back for a request of its class
// and not for a longer prompt's, and slices of other capacities are
// dropped.
func TestIDPoolClasses(t *testing.T) {
	var p idPool
	small := p.get(2600) // a 10 KB conversation's prompt
	assert.GreaterOrEqual(t, cap(small), 2600+2600/4)
	assert.Empty(t, small)
	large := p.get(26000) // a 100 KB one's
	assert.GreaterOrEqual(t, cap(large), 26000+26000/4)
	p.put(small[:10])
	p.put(large)
	// sync.Pool may drop what it holds at any time (a GC), so only what
	// is handed out is checked, not that it is the same slice.
	got := p.get(26000)
	assert.GreaterOrEqual(t, cap(got), 26000+26000/4, "a longer prompt never gets the small class's slice")
	got = p.get(2600)
	assert.GreaterOrEqual(t, cap(got), 2600+2600/4)
	assert.Empty(t, got)
	p.put(make([]uint32, 0, 3000)) // not a class's capacity: dropped, no panic
	p.put(nil)
	huge := p.get(4 << 20) // beyond the largest class: made to measure
	assert.Equal(t, (4<<20)+(4<<20)/4, cap(huge))
	assert.True(t, sameArray(large, large[:0]))
	assert.False(t, sameArray(large, got))
	assert.False(t, sameArray(nil, got))
}
