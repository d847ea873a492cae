package kvroute_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention"
)

// switchStore is a retention.Memory that fails every call while down.
type switchStore struct {
	*retention.Memory
	down atomic.Bool
}

var errDown = errors.New("store unreachable")

func (s *switchStore) Put(ctx context.Context, k string, v []byte, ttl time.Duration) error {
	if s.down.Load() {
		return errDown
	}
	return s.Memory.Put(ctx, k, v, ttl)
}

func (s *switchStore) Take(ctx context.Context, k string) ([]byte, bool, error) {
	if s.down.Load() {
		return nil, false, errDown
	}
	return s.Memory.Take(ctx, k)
}

// syncBuffer is a bytes.Buffer safe for a logger used by several turns.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// A store outage logs one line when it starts and one when the store
// answers again, however many turns fail in between; no turn fails.
func TestStoreOutageLoggedOnce(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	mem, err := retention.NewMemory()
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mem.Close() })
	store := &switchStore{Memory: mem}
	var logs syncBuffer
	r := newRouter(t, c, kvroute.WithStore(store), kvroute.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	url := serve(t, r)
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8, messages: []message{{Role: "system", Content: systemPrompt}}}
	turn := func() {
		conv.say(userText(len(conv.messages)))
		res := post(t, url, conv.path, conv.body(), nil)
		require.Equal(t, http.StatusOK, res.status)
		conv.hear(res.text)
	}
	turn()
	store.down.Store(true)
	for range 20 {
		turn()
	}
	store.down.Store(false)
	turn()
	turn()
	assert.Equal(t, 1, strings.Count(logs.String(), "store failing"), logs.String())
	assert.Equal(t, 1, strings.Count(logs.String(), "store answering again"), logs.String())
	assert.Contains(t, logs.String(), "failed_calls=40", "20 turns, a take and a put each")
	assert.Equal(t, int64(40), r.Stats().StoreErrors)
}
