// Package observed keeps what an observer was told, in order, for tests
// to read back: the one implementation behind kvroutetest.Records, which
// kvroute's own in-package tests (which cannot import kvroutetest) use
// directly, as an ObserverFunc.
package observed

import "sync"

// Log keeps copies of the values Add was given, in order, until Take
// forgets them. It is safe for concurrent use; the zero value is ready.
type Log[T any] struct {
	mu    sync.Mutex
	items []T
}

// Add keeps a copy of *v.
func (l *Log[T]) Add(v *T) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.items = append(l.items, *v)
}

// Last returns the value added last (and not taken), the zero T when
// there is none.
func (l *Log[T]) Last() T {
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(l.items) == 0 {
		var zero T
		return zero
	}
	return l.items[len(l.items)-1]
}

// All returns a copy of the values added and not taken, in order.
func (l *Log[T]) All() []T {
	l.mu.Lock()
	defer l.mu.Unlock()
	return append([]T(nil), l.items...)
}

// Take returns and forgets the last value match accepts, and forgets every
// earlier one it accepts; false when it accepts none.
func (l *Log[T]) Take(match func(*T) bool) (T, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	var got T
	found := false
	kept := l.items[:0]
	for i := range l.items {
		if match(&l.items[i]) {
			got, found = l.items[i], true
			continue
		}
		kept = append(kept, l.items[i])
	}
	clear(l.items[len(kept):]) // nothing is held past its forgetting
	l.items = kept
	return got, found
}
