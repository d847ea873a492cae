package budget_test

import (
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// Running counts the tokens of the requests running on each engine, added
// and removed by several callers at once (router replicas sharing the
// Budget): each sees the others', the count never enters Held or the
// budget, and an engine whose requests all ended counts 0.
func TestRunningShared(t *testing.T) {
	b, err := budget.New(budget.WithCapacity(1000))
	require.NoError(t, err)
	assert.Zero(t, b.Running("d", 0), "an engine never seen")
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 100 {
				b.Running("d", 30)
				b.Running("e", 7)
			}
		})
	}
	wg.Wait()
	assert.EqualValues(t, 4*100*30, b.Running("d", 0))
	assert.EqualValues(t, 4*100*7, b.Running("e", 0))
	held, _ := b.Held("d", t0)
	assert.Zero(t, held, "running requests are not holds")
	assert.EqualValues(t, 4*100*30-50, b.Running("d", -50))
	for range 4 {
		wg.Go(func() {
			for range 100 {
				b.Running("e", -7)
			}
		})
	}
	wg.Wait()
	assert.Zero(t, b.Running("e", 0))
}

// Stats.Overdue counts the holds Expired handed to a caller to release
// (a caller that waits until every hold it was handed is taken counts
// them, as it counts Released), not those that lapsed at the grace's end.
func TestOverdueCounted(t *testing.T) {
	const ttl, grace = 450 * time.Second, 30 * time.Second
	b, err := budget.New(budget.WithGrace(grace), budget.WithCapacity(10_000))
	require.NoError(t, err)
	for key, after := range map[string]time.Duration{"a": 0, "b": 10 * time.Second, "c": time.Minute} {
		at := t0.Add(after)
		require.NoError(t, b.Add(budget.Hold{Key: key, Engine: "d", Tokens: 32, Created: at, Expires: at.Add(ttl)}))
	}
	require.Len(t, b.Expired("d", t0.Add(ttl+15*time.Second)), 2, "a and b")
	b.Held("d", t0.Add(time.Minute+ttl+grace)) // c lapses
	s := b.Stats()
	assert.EqualValues(t, 3, s.Expired)
	assert.EqualValues(t, 2, s.Overdue)
}
