package enginepool

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// An endpoint is ejected at After consecutive failures, for a backoff
// that grows on failing again after the ejection ran out; a success
// re-admits it and resets the count.
func TestHealth(t *testing.T) {
	var h Health
	e := Ejection{After: 2, Backoff: time.Second, MaxDelay: time.Minute}
	now := time.Unix(1_700_000_000, 0)
	_, _, ejected := h.Failure(e, now)
	assert.False(t, ejected)
	assert.True(t, h.Eligible(now))
	fails, until, ejected := h.Failure(e, now)
	assert.True(t, ejected)
	assert.Equal(t, 2, fails)
	first := until.Sub(now)
	assert.InDelta(t, float64(time.Second), float64(first), float64(time.Second)/5+1, "the first backoff, randomized by 20%")
	assert.False(t, h.Eligible(now))
	_, _, ejected = h.Failure(e, now.Add(first/2))
	assert.False(t, ejected, "already ejected")
	_, until, ejected = h.Failure(e, until)
	assert.True(t, ejected, "failing again once the ejection ran out")
	assert.True(t, h.Eligible(until))
	assert.True(t, h.Success(), "it was ejected")
	fails, _ = h.State()
	assert.Zero(t, fails)
	assert.False(t, h.Success())
}
