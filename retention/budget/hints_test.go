package budget_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// SetPrefilled's record is what Prefilled returns for the key, the latest
// one, until the horizon; nothing for a key never recorded.
func TestPrefilled(t *testing.T) {
	b, err := budget.New(budget.WithHorizon(10 * time.Minute))
	require.NoError(t, err)
	now := t0
	assert.Empty(t, b.Prefilled("a", now))
	b.SetPrefilled("a", "http://p0", now)
	b.SetPrefilled("b", "http://p1", now)
	b.SetPrefilled("", "http://p1", now)
	b.SetPrefilled("c", "", now)
	assert.Equal(t, "http://p0", b.Prefilled("a", now.Add(time.Minute)))
	assert.Equal(t, "http://p1", b.Prefilled("b", now.Add(time.Minute)))
	assert.Empty(t, b.Prefilled("c", now))
	b.SetPrefilled("a", "http://p1", now.Add(5*time.Minute)) // the conversation's later turn
	assert.Equal(t, "http://p1", b.Prefilled("a", now.Add(12*time.Minute)), "the later record, past the earlier's horizon")
	assert.Empty(t, b.Prefilled("b", now.Add(10*time.Minute)), "past the horizon")
	assert.Empty(t, b.Prefilled("a", now.Add(15*time.Minute)))
	for i := range 5000 { // records past the horizon are forgotten as time goes
		b.SetPrefilled(string(rune('A'+i%26))+time.Duration(i).String(), "http://p0", now.Add(time.Duration(i)*time.Second))
	}
	last := now.Add(4999 * time.Second)
	assert.Empty(t, b.Prefilled("A0s", last))
	assert.Equal(t, "http://p0", b.Prefilled(string(rune('A'+4999%26))+time.Duration(4999).String(), last))
}
