package discovery_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport"
	"github.com/bidikv/bidikv/transport/discovery"
)

// syncBuffer is a log sink safe for concurrent writes.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) count(sub string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return strings.Count(s.b.String(), sub)
}

// applied records the sets a Watcher applies.
type applied struct {
	mu   sync.Mutex
	sets [][]string
	fail error
}

func (a *applied) apply(eps []transport.Endpoint) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.fail != nil {
		return a.fail
	}
	a.sets = append(a.sets, names(eps))
	return nil
}

func (a *applied) all() [][]string {
	a.mu.Lock()
	defer a.mu.Unlock()
	return append([][]string(nil), a.sets...)
}

func TestWatcherRefresh(t *testing.T) {
	dns := newFakeDNS()
	dns.setHost("d.test", "10.0.0.1")
	src, err := discovery.NewDNS("d.test:8200", discovery.WithResolver(dns))
	require.NoError(t, err)
	var logs syncBuffer
	got := &applied{}
	w, err := discovery.NewWatcher(src, got.apply, discovery.WithName("decode"),
		discovery.WithLogger(slog.New(slog.NewTextHandler(&logs, nil))))
	require.NoError(t, err)
	ctx := context.Background()

	require.NoError(t, w.Refresh(ctx))
	require.NoError(t, w.Refresh(ctx))
	assert.Equal(t, [][]string{{"http://10.0.0.1:8200"}}, got.all(), "an unchanged set is applied once")

	dns.setHost("d.test", "10.0.0.2", "10.0.0.1")
	require.NoError(t, w.Refresh(ctx))
	assert.Equal(t, []string{"http://10.0.0.1:8200", "http://10.0.0.2:8200"}, got.all()[1])

	// Temporary failures keep the last good set, logged once.
	dns.setFail(errServFail)
	for range 3 {
		assert.Error(t, w.Refresh(ctx))
	}
	assert.Len(t, got.all(), 2, "nothing applied while resolution fails")
	assert.Equal(t, 1, logs.count("resolution failed"))
	dns.setFail(nil)
	require.NoError(t, w.Refresh(ctx))
	assert.Equal(t, 1, logs.count("resolution works again"))
	assert.Len(t, got.all(), 2, "the same set after recovery is not applied again")

	// No records: the pool is emptied, once, and logged once.
	dns.setHost("d.test")
	for range 2 {
		assert.ErrorIs(t, w.Refresh(ctx), discovery.ErrNoRecords)
	}
	sets := got.all()
	require.Len(t, sets, 3)
	assert.Empty(t, sets[2])
	assert.Equal(t, 1, logs.count("the pool is empty"))
	dns.setHost("d.test", "10.0.0.3")
	require.NoError(t, w.Refresh(ctx))
	assert.Equal(t, []string{"http://10.0.0.3:8200"}, got.all()[3])

	// A set the consumer refuses is a failure; the next refresh retries it.
	got.mu.Lock()
	got.fail = errors.New("refused")
	got.mu.Unlock()
	dns.setHost("d.test", "10.0.0.4")
	assert.Error(t, w.Refresh(ctx))
	got.mu.Lock()
	got.fail = nil
	got.mu.Unlock()
	require.NoError(t, w.Refresh(ctx))
	assert.Equal(t, []string{"http://10.0.0.4:8200"}, got.all()[4])

	st := w.Stats()
	assert.Equal(t, discovery.WatchStats{Refreshes: 12, Changes: 5, Failures: 4, Empty: 2, Endpoints: 1}, st)
	assert.Equal(t, 1, logs.count("were refused"))
}

func TestWatcherOptions(t *testing.T) {
	src, err := discovery.NewDNS("d.test:8200", discovery.WithResolver(newFakeDNS()))
	require.NoError(t, err)
	nop := func([]transport.Endpoint) error { return nil }
	for _, opts := range [][]discovery.WatchOption{
		{discovery.WithInterval(0)}, {discovery.WithInterval(-time.Second)}, {discovery.WithTimeout(-1)},
	} {
		_, err := discovery.NewWatcher(src, nop, opts...)
		assert.ErrorIs(t, err, discovery.ErrInvalidConfig)
	}
	_, err = discovery.NewWatcher(nil, nop)
	assert.ErrorIs(t, err, discovery.ErrInvalidConfig)
	_, err = discovery.NewWatcher(src, nil)
	assert.ErrorIs(t, err, discovery.ErrInvalidConfig)
}

// TestWatcherRun checks that Run refreshes on its own and returns when its
// context ends (goleak in TestMain).
func TestWatcherRun(t *testing.T) {
	dns := newFakeDNS()
	dns.setHost("d.test", "10.0.0.1")
	src, err := discovery.NewDNS("d.test:8200", discovery.WithResolver(dns))
	require.NoError(t, err)
	changed := make(chan []string, 16)
	w, err := discovery.NewWatcher(src, func(eps []transport.Endpoint) error {
		changed <- names(eps)
		return nil
	}, discovery.WithInterval(time.Millisecond))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); w.Run(ctx) }()
	wait := func() []string {
		select {
		case s := <-changed:
			return s
		case <-time.After(10 * time.Second):
			t.Fatal("no refresh")
			return nil
		}
	}
	assert.Equal(t, []string{"http://10.0.0.1:8200"}, wait())
	dns.setHost("d.test", "10.0.0.2")
	assert.Equal(t, []string{"http://10.0.0.2:8200"}, wait())
	cancel()
	<-done
}
