package budget_test

import (
	"sync"
	"testing"

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
	held, bud := b.Held("d", t0)
	assert.Zero(t, held, "running requests are not holds")
	assert.EqualValues(t, 500, bud)
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
