package budget_test

import (
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/budget"
)

// A Budget is safe for concurrent use: turns adding, returning and
// releasing holds on several engines at once (run with -race), and no hold
// is released twice or both released and returned.
func TestBudgetConcurrent(t *testing.T) {
	b, err := budget.New(budget.WithCapacity(40_000), budget.WithRefresh(time.Second))
	require.NoError(t, err)
	const workers, perWorker = 4, 500
	var mu sync.Mutex
	outcome := map[string]string{}
	mark := func(key, what string) {
		mu.Lock()
		defer mu.Unlock()
		if prev, ok := outcome[key]; ok {
			t.Errorf("%s: %s after %s", key, what, prev)
		}
		outcome[key] = what
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			eng := fmt.Sprint("d", w%2)
			for i := range perWorker {
				now := t0.Add(time.Duration(i) * time.Second)
				key := fmt.Sprintf("w%d-%d", w, i)
				if err := b.Add(budget.Hold{Key: key, Engine: eng, Tokens: 1000 + i%7*500, Created: now, Expires: now.Add(ttl),
					Features: budget.Features{Turn: 1 + i%4, Class: fmt.Sprint("c", i%3)}, Saved: time.Second}); err != nil {
					t.Error(err)
					return
				}
				for _, v := range b.Victims(eng, 0, now) {
					mark(v.Key, "released")
				}
				if i%3 == 0 && i > 0 {
					prev := fmt.Sprintf("w%d-%d", w, i-1)
					if b.Return(prev, now) {
						mark(prev, "returned")
					}
				}
				if i%50 == 0 {
					b.Usage(now)
					b.Snapshot(now, ttl)
				}
			}
		}()
	}
	wg.Wait()
	end := t0.Add(perWorker * time.Second)
	for _, u := range b.Usage(end) {
		assert.LessOrEqual(t, u.HeldTokens, u.Budget, u.Engine)
	}
	st := b.Stats()
	assert.Equal(t, int64(workers*perWorker), st.Added)
	assert.Equal(t, int64(workers*perWorker), st.Released+st.Returned+st.Expired+int64(st.Holds))
}
