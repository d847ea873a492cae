package kvroute

import (
	"fmt"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// live counts the ledger's records unexpired at now, as DecodeKV does.
func (l *kvLedger) live(now time.Time) (n int) {
	for _, h := range l.m {
		if h.expires > now.UnixNano() {
			n++
		}
	}
	return n
}

func TestLedgerSweeps(t *testing.T) {
	var l kvLedger
	t0 := time.Unix(1_700_000_000, 0)
	const ttl = 480 * time.Second
	for i := range 3000 {
		now := t0.Add(time.Duration(i) * 100 * time.Millisecond)
		l.put(fmt.Sprint("k", i), "http://d0", 100, now.Add(ttl), now)
	}
	// 3000 puts over 300 s: none expired yet.
	assert.Equal(t, 3000, len(l.m))
	l.take("k7")
	assert.Equal(t, 2999, len(l.m))

	// 500 s in, the puts of the first 20 s (k0 to k200, of which k7 was
	// taken) have expired: puts find them a few at a time. 3,000 puts of
	// one key, each looking at 32 records of about 2,800, leave any one of
	// them unvisited with a chance below 1e-14.
	now := t0.Add(500 * time.Second)
	l.put("k2500", "http://d0", 100, now.Add(ttl), now) // replaced: a later expiry
	for range 3000 {
		l.put("late", "http://d0", 100, now.Add(ttl), now)
	}
	assert.Equal(t, 2999-200+1, len(l.m))
	assert.Equal(t, len(l.m), l.refs[0])
	assert.Equal(t, len(l.m), l.live(now))

	// A full sweep (DecodeKV's) drops exactly what has expired.
	later := t0.Add(250*time.Second + ttl + 50*time.Millisecond)
	l.sweep(later.UnixNano(), -1)
	_, ok := l.m[l.hash("k2500")]
	assert.True(t, ok, "the replaced record outlives its first expiry")
	_, ok = l.m[l.hash("k2499")]
	assert.False(t, ok)
	_, ok = l.m[l.hash("k2501")]
	assert.True(t, ok)
	assert.Equal(t, len(l.m), l.live(later))
}

func TestLedgerReinternsChurnedEndpoints(t *testing.T) {
	var l kvLedger
	t0 := time.Unix(1_700_000_000, 0)
	// 200 engines, one handle each, all expired 10 s later.
	for i := range 200 {
		l.put(fmt.Sprint("old", i), fmt.Sprintf("http://10.0.0.%d:8000", i), 10, t0.Add(10*time.Second), t0)
	}
	require.Len(t, l.eps, 200)
	now := t0.Add(time.Minute)
	for i := range 4096 {
		l.put(fmt.Sprint("new", i), "http://10.0.1.1:8000", 10, now.Add(time.Hour), now)
	}
	assert.Equal(t, []string{"http://10.0.1.1:8000"}, l.eps, "only the endpoint still holding records stays interned")
	assert.Equal(t, []int{4096}, l.refs)
	for _, h := range l.m {
		assert.Equal(t, uint32(0), h.ep)
	}
}
