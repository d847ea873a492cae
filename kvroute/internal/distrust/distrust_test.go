package distrust

import (
	"strconv"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// A conversation avoids an engine for TTL after its last turn that did;
// at most MaxKept conversations are remembered, the one expiring first
// going first.
func TestAvoided(t *testing.T) {
	var a Avoided
	now := time.Unix(1_700_000_000, 0)
	assert.Empty(t, a.Avoid([]string{"k"}, now))
	a.Add([]string{"k", "k2"}, "http://p1", now)
	a.Add([]string{"k"}, "http://p2", now)
	a.Add([]string{"k"}, "http://p1", now)
	assert.Equal(t, []string{"http://p1", "http://p2"}, a.Avoid([]string{"k"}, now.Add(TTL/2)))
	assert.Equal(t, []string{"http://p1", "http://p2"}, a.Avoid([]string{"k"}, now.Add(TTL)), "the turn at TTL/2 kept it")
	assert.Empty(t, a.Avoid([]string{"k2"}, now.Add(TTL)), "k2 lapsed")
	for i := range MaxKept {
		a.Add([]string{strconv.Itoa(i)}, "http://p3", now.Add(time.Duration(i+1)*time.Millisecond))
	}
	assert.LessOrEqual(t, len(a.m), MaxKept)
	assert.Empty(t, a.Avoid([]string{"0"}, now.Add(TTL/2)), "the one expiring first went")
}
