package kvroute_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"sync"
	"time"

	"github.com/bidikv/bidikv/kvroute"
)

// mapStore is a Store that keeps handles in a map under a mutex, with a
// clock for expiry. It keeps the Store contract (store.go): Take removes
// what it returns, atomically; Put copies its value, which is the
// caller's once Put returns; a ttl of 0 or less is refused.
// kvroutetest.TestStore checks it (extend_store_test.go).
type mapStore struct {
	now  func() time.Time
	mu   sync.Mutex
	vals map[string]mapValue
}

type mapValue struct {
	b       []byte
	expires time.Time
}

func newMapStore(now func() time.Time) *mapStore {
	return &mapStore{now: now, vals: map[string]mapValue{}}
}

func (s *mapStore) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if err := ctx.Err(); err != nil {
		return err
	}
	if ttl <= 0 {
		return errors.New("mapStore: the ttl must be positive")
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	s.vals[key] = mapValue{b: append([]byte(nil), value...), expires: s.now().Add(ttl)}
	return nil
}

func (s *mapStore) Take(ctx context.Context, key string) ([]byte, bool, error) {
	if err := ctx.Err(); err != nil {
		return nil, false, err
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	v, ok := s.vals[key]
	delete(s.vals, key)
	if !ok || !s.now().Before(v.expires) {
		return nil, false, nil
	}
	return v.b, true, nil
}

// len returns the number of handles kept.
func (s *mapStore) len() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.vals)
}

var _ kvroute.Store = (*mapStore)(nil)

// A custom Store (WithStore) keeps the handles the Router retains: each
// turn takes its conversation's handle and puts the next one back, so the
// store holds one live handle per conversation.
func ExampleStore() {
	p, d, stop := startEngines(1)
	defer stop()

	store := newMapStore(time.Now)
	router, err := kvroute.New(kvroute.WithPrefill(p.URL()), kvroute.WithDecode(d[0].URL()),
		kvroute.WithStore(store)) // the registration line
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	messages := []map[string]string{
		{"role": "system", "content": agentPrompt},
		{"role": "user", "content": "The test TestParse fails with an index out of range."},
	}
	for turn := 1; turn <= 3; turn++ {
		reply, reuse, _ := ask(router, messages, 8)
		fmt.Printf("turn %d: %s; the store keeps %d handle(s)\n", turn, reuse, store.len())
		messages = append(messages,
			map[string]string{"role": "assistant", "content": reply},
			map[string]string{"role": "user", "content": "Go on."})
	}
	// Output:
	// turn 1: miss; the store keeps 1 handle(s)
	// turn 2: hit; the store keeps 1 handle(s)
	// turn 3: hit; the store keeps 1 handle(s)
}
