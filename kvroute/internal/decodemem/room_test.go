package decodemem

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// A principal may release other tenants' holds up to Rate shares of the
// capacity, refilled at Rate a minute; a negative Rate is no limit; at
// most MaxPrincipals are remembered.
func TestRoomLimits(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	l := RoomLimits{Rate: 0.5}
	assert.Equal(t, int64(500), l.Allowance("a", 1000, now))
	l.Charge("a", 400, 1000, now)
	assert.InDelta(t, 100, l.Allowance("a", 1000, now), 1)
	assert.Equal(t, int64(500), l.Allowance("b", 1000, now), "another principal's bucket is full")
	assert.InDelta(t, 350, l.Allowance("a", 1000, now.Add(30*time.Second)), 1, "refilled at Rate a minute")
	assert.Equal(t, int64(500), l.Allowance("a", 1000, now.Add(time.Hour)), "up to Rate")
	for i := range MaxPrincipals + 10 {
		l.Charge(strconv.Itoa(i), 1, 1000, now.Add(time.Duration(i)))
	}
	assert.LessOrEqual(t, len(l.m), MaxPrincipals)
	off := RoomLimits{Rate: -1}
	assert.Equal(t, int64(-1), off.Allowance("a", 1000, now))
}
