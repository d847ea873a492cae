package kvroutetest_test

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention"
)

func TestStoreMemory(t *testing.T) {
	// Not goleak.VerifyTestMain: this package's TestMain, if any, belongs to
	// the simulated engines' tests.
	defer goleak.VerifyNone(t, goleak.IgnoreCurrent())
	kvroutetest.TestStore(t, func(t *testing.T) kvroute.Store {
		m, err := retention.NewMemory()
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = m.Close() })
		return m
	})
}

// TestStoreReference runs the suite against mapStore with no fault, so that
// TestStoreCatchesFaults knows each fault alone makes the suite fail.
func TestStoreReference(t *testing.T) {
	kvroutetest.TestStore(t, func(*testing.T) kvroute.Store { return newMapStore("") })
}

// faultEnv names the fault a child process of TestStoreCatchesFaults injects.
const faultEnv = "KVROUTETEST_STORE_FAULT"

// TestStoreCatchesFaults checks that the suite fails a store with each of a
// set of bugs, in the subtest meant to catch it. Each case re-runs the test
// binary, because a failing *testing.T cannot be contained in-process.
func TestStoreCatchesFaults(t *testing.T) {
	if testing.Short() {
		t.Skip("re-runs the test binary once per fault")
	}
	if fault := os.Getenv(faultEnv); fault != "" {
		kvroutetest.TestStore(t, func(*testing.T) kvroute.Store { return newMapStore(fault) })
		return
	}
	tests := []struct {
		fault   string
		subtest string
	}{
		{"peek", "TakeRemoves"},
		{"lastPutLoses", "Overwrite"},
		{"noExpiry", "Expiry"},
		{"truncate", "LargeValue"},
		{"emptyIsMiss", "EmptyValue"},
		{"alias", "PutCopiesValue"},
		{"ignoreContext", "CancelledContext"},
		{"acceptBadTTL", "InvalidTTL"},
		{"foldCase", "OddKeys"},
		{"racyTake", "ConcurrentTake"},
	}
	for _, tt := range tests {
		t.Run(tt.fault, func(t *testing.T) {
			cmd := exec.CommandContext(t.Context(), os.Args[0],
				"-test.run=^TestStoreCatchesFaults$/^"+tt.subtest+"$", "-test.v", "-test.count=1")
			cmd.Env = append(os.Environ(), faultEnv+"="+tt.fault)
			out, err := cmd.CombinedOutput()
			var exit *exec.ExitError
			require.ErrorAs(t, err, &exit, "the suite passed a store with fault %q:\n%s", tt.fault, out)
			assert.Contains(t, string(out), "--- FAIL: TestStoreCatchesFaults/"+tt.subtest)
			assert.NotContains(t, string(out), "panic:")
		})
	}
}

// mapStore is a simple correct Store, unless fault names a bug to inject.
type mapStore struct {
	fault string
	mu    sync.Mutex
	m     map[string]mapEntry
}

type mapEntry struct {
	value   []byte
	expires time.Time
}

func newMapStore(fault string) *mapStore {
	return &mapStore{fault: fault, m: make(map[string]mapEntry)}
}

func (s *mapStore) Put(ctx context.Context, key string, value []byte, ttl time.Duration) error {
	if err := ctx.Err(); err != nil && s.fault != "ignoreContext" {
		return err
	}
	if ttl <= 0 {
		if s.fault != "acceptBadTTL" {
			return errors.New("mapStore: ttl must be positive")
		}
		ttl = time.Hour
	}
	if s.fault == "noExpiry" {
		ttl = time.Hour
	}
	if s.fault == "foldCase" {
		key = strings.ToLower(key)
	}
	if s.fault == "truncate" && len(value) > 1024 {
		value = value[:1024]
	}
	if s.fault != "alias" {
		value = append([]byte{}, value...)
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.m[key]; ok && s.fault == "lastPutLoses" {
		return nil
	}
	s.m[key] = mapEntry{value: value, expires: time.Now().Add(ttl)}
	return nil
}

func (s *mapStore) Take(ctx context.Context, key string) ([]byte, bool, error) {
	if err := ctx.Err(); err != nil && s.fault != "ignoreContext" {
		return nil, false, err
	}
	if s.fault == "foldCase" {
		key = strings.ToLower(key)
	}
	s.mu.Lock()
	e, ok := s.m[key]
	if ok && s.fault == "racyTake" {
		// Read, then delete under a second lock: two takers can both win.
		s.mu.Unlock()
		time.Sleep(time.Millisecond)
		s.mu.Lock()
	}
	if ok && s.fault != "peek" {
		delete(s.m, key)
	}
	s.mu.Unlock()
	if !ok || time.Now().After(e.expires) || (s.fault == "emptyIsMiss" && len(e.value) == 0) {
		return nil, false, nil
	}
	return e.value, true, nil
}
