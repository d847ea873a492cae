package kvroute_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Extension example: a Store is one file (this one) and one registration
// line (WithStore). mapStore keeps handles in a map under a mutex, with the
// router's clock for expiry; it copies what Put is given, as the Store
// contract says, and passes kvroutetest.TestStore.
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
		return kvroute.ErrInvalidConfig // any error: a ttl <= 0 is refused
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

var _ kvroute.Store = (*mapStore)(nil)

func TestExtendStore(t *testing.T) {
	kvroutetest.TestStore(t, func(*testing.T) kvroute.Store { return newMapStore(time.Now) })

	c := kvroutetest.NewCluster(t, 1, 1)
	store := newMapStore(time.Now)
	rec := &lastTurn{}
	url := serve(t, newRouter(t, c, kvroute.WithStore(store), kvroute.WithObserver(rec), kvroute.WithThreshold(0))) // the registration line
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8}
	for i := range 3 {
		conv.say(userText(i))
		res := post(t, url, conv.path, conv.body(), nil)
		require.Equal(t, http.StatusOK, res.status)
		conv.hear(res.text)
		if i > 0 {
			assert.Equal(t, kvroute.ReuseHit, rec.last().Reuse, "turn %d reuses the handle the map kept (%s)", i, rec.last().MissReason)
		}
		assert.True(t, rec.last().Stored)
	}
	store.mu.Lock()
	assert.Len(t, store.vals, 1, "the conversation's live handle")
	store.mu.Unlock()
}
