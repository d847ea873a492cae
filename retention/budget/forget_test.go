package budget_test

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// Engines that leave the caller's pool leave the ledger once they hold
// nothing and run nothing, so that the ledger follows the engines in use
// (pods come and go under new addresses), not every engine ever seen; the
// engines kept stay whole, their holds still found by key after another
// engine's removal moved them in the ledger.
func TestForgetEnginesThatLeft(t *testing.T) {
	now := time.Unix(1_700_000_000, 0)
	b, err := budget.New(budget.WithCapacity(10_000), budget.WithBlockSize(16))
	require.NoError(t, err)
	engines := func() []string {
		var out []string
		for _, u := range b.Usage(now) {
			out = append(out, u.Engine)
		}
		slices.Sort(out)
		return out
	}
	hold := func(engine, key string, tokens int) {
		require.NoError(t, b.Add(budget.Hold{Key: key, Engine: engine, Tokens: tokens, Created: now, Expires: now.Add(time.Minute)}))
	}
	// Many pods over time: each held a conversation and left.
	for i := range 50 {
		hold(fmt.Sprintf("http://10.0.0.%d:8000", i), fmt.Sprintf("conv-%d", i), 100)
	}
	hold("http://10.0.1.1:8000", "kept-a", 160)
	hold("http://10.0.1.2:8000", "kept-b", 320)
	b.Running("http://10.0.0.7:8000", 500) // a leg still in flight on a pod that left
	inPool := func(e string) bool { return e == "http://10.0.1.1:8000" || e == "http://10.0.1.2:8000" }
	assert.Zero(t, b.Forget(now, inPool), "every engine still holds")
	for i := range 50 {
		require.True(t, b.Return(fmt.Sprintf("conv-%d", i), now))
	}
	assert.Equal(t, 49, b.Forget(now, inPool), "the idle engines that left, not the one running a leg")
	assert.Equal(t, []string{"http://10.0.0.7:8000", "http://10.0.1.1:8000", "http://10.0.1.2:8000"}, engines())
	b.Running("http://10.0.0.7:8000", -500)
	assert.Equal(t, 1, b.Forget(now, inPool))
	assert.Equal(t, []string{"http://10.0.1.1:8000", "http://10.0.1.2:8000"}, engines())
	// The kept engines' holds are whole and found by key.
	held, _ := b.Held("http://10.0.1.2:8000", now)
	assert.EqualValues(t, 320, held)
	assert.True(t, b.Return("kept-b", now))
	assert.True(t, b.Return("kept-a", now))
	held, _ = b.Held("http://10.0.1.1:8000", now)
	assert.Zero(t, held)
	// Kept while in the pool, however idle; a forgotten engine starts afresh.
	assert.Zero(t, b.Forget(now, inPool))
	hold("http://10.0.0.3:8000", "back", 48)
	held, _ = b.Held("http://10.0.0.3:8000", now)
	assert.EqualValues(t, 48, held)
	assert.Equal(t, 3, b.Forget(now.Add(2*time.Minute), func(string) bool { return false }), "its hold expired: every idle engine goes")
	assert.Empty(t, engines())
}
