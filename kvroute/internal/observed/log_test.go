package observed

import (
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
)

type rec struct {
	id string
	n  int
}

func TestLog(t *testing.T) {
	var l Log[rec]
	assert.Equal(t, rec{}, l.Last(), "empty")
	assert.Empty(t, l.All())
	_, ok := l.Take(func(*rec) bool { return true })
	assert.False(t, ok)

	for i, id := range []string{"a", "b", "a", "c"} {
		r := rec{id, i}
		l.Add(&r)
		r.n = -1 // a copy was kept
	}
	assert.Equal(t, rec{"c", 3}, l.Last())
	assert.Equal(t, []rec{{"a", 0}, {"b", 1}, {"a", 2}, {"c", 3}}, l.All(), "in order")

	got, ok := l.Take(func(r *rec) bool { return r.id == "a" })
	assert.True(t, ok)
	assert.Equal(t, rec{"a", 2}, got, "the last one accepted")
	assert.Equal(t, []rec{{"b", 1}, {"c", 3}}, l.All(), "every one accepted is forgotten")
	_, ok = l.Take(func(r *rec) bool { return r.id == "a" })
	assert.False(t, ok, "taken already")

	all := l.All()
	all[0].n = 99
	assert.Equal(t, rec{"b", 1}, l.All()[0], "All returns a copy")
}

func TestLogConcurrent(t *testing.T) {
	var l Log[rec]
	var wg sync.WaitGroup
	for i := range 8 {
		wg.Go(func() {
			for j := range 100 {
				l.Add(&rec{n: i*100 + j})
				_ = l.Last()
			}
		})
	}
	wg.Wait()
	assert.Len(t, l.All(), 800)
}
