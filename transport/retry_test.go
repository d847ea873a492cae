package transport_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/cenkalti/backoff/v4"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport"
)

// instantTimer is a virtual backoff timer: it fires at once and records
// every wait it was asked for.
type instantTimer struct {
	mu    sync.Mutex
	waits []time.Duration
	c     chan time.Time
}

func newInstantTimer() *instantTimer { return &instantTimer{c: make(chan time.Time, 1)} }

func (t *instantTimer) Start(d time.Duration) {
	t.mu.Lock()
	t.waits = append(t.waits, d)
	t.mu.Unlock()
	t.c <- time.Time{}
}
func (t *instantTimer) Stop()               {}
func (t *instantTimer) C() <-chan time.Time { return t.c }

func (t *instantTimer) Waits() []time.Duration {
	t.mu.Lock()
	defer t.mu.Unlock()
	return append([]time.Duration(nil), t.waits...)
}

// neverTimer never fires.
type neverTimer struct{}

func (neverTimer) Start(time.Duration) {}
func (neverTimer) Stop()               {}
func (neverTimer) C() <-chan time.Time { return nil }

func policy(tm backoff.Timer, p transport.RetryPolicy) transport.RetryPolicy {
	p.NewTimer = func() backoff.Timer { return tm }
	return p
}

var errUpstream = errors.New("upstream failed")

// ms converts milliseconds to durations.
func ms(v ...int) []time.Duration {
	out := make([]time.Duration, len(v))
	for i, n := range v {
		out[i] = time.Duration(n) * time.Millisecond
	}
	return out
}

func TestRetryOn503WithRetryAfter(t *testing.T) {
	var mu sync.Mutex
	calls := 0
	srv, c := newServer(t, "127.0.0.1", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		mu.Lock()
		calls++
		n := calls
		mu.Unlock()
		if n == 1 {
			w.Header().Set("Retry-After", "2")
			w.WriteHeader(http.StatusServiceUnavailable)
			return
		}
		_, _ = w.Write([]byte("ok"))
	}))
	tm := newInstantTimer()
	var retried []int
	p := policy(tm, transport.RetryPolicy{OnRetry: func(attempt int, err error, _ time.Duration) {
		retried = append(retried, attempt)
	}})
	var attempts []int
	err := transport.Retry(t.Context(), p, func(attempt int) (time.Duration, error) {
		attempts = append(attempts, attempt)
		resp, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{})
		if err != nil {
			if transport.Retryable(nil, err) {
				return 0, err
			}
			return 0, transport.Permanent(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode == http.StatusOK {
			return 0, nil
		}
		err = fmt.Errorf("status %d", resp.StatusCode)
		if !transport.Retryable(resp, nil) {
			return 0, transport.Permanent(err)
		}
		ra, _ := transport.RetryAfter(resp.Header, time.Now())
		return ra, err
	})
	require.NoError(t, err)
	assert.Equal(t, []int{1, 2}, attempts)
	assert.Equal(t, []int{1}, retried)
	assert.Equal(t, []time.Duration{2 * time.Second}, tm.Waits(), "Retry-After beats the 50ms backoff")
}

func TestRetry(t *testing.T) {
	noJitter := transport.RetryPolicy{RandomizationFactor: -1}
	tests := []struct {
		name      string
		policy    transport.RetryPolicy
		results   []error         // per attempt; missing entries are errUpstream
		hints     []time.Duration // Retry-After per attempt
		wantErr   error           // nil for success
		wantCalls int
		wantWaits []time.Duration
	}{
		{
			name:      "success first time",
			results:   []error{nil},
			wantCalls: 1,
		},
		{
			name:      "permanent stops at once, unwrapped",
			results:   []error{transport.Permanent(errUpstream)},
			wantErr:   errUpstream,
			wantCalls: 1,
		},
		{
			name:      "backoff.Permanent works too",
			results:   []error{backoff.Permanent(errUpstream)},
			wantErr:   errUpstream,
			wantCalls: 1,
		},
		{
			name:      "max attempts default 3, last error returned",
			policy:    noJitter,
			wantErr:   errUpstream,
			wantCalls: 3,
			wantWaits: []time.Duration{50 * time.Millisecond, 100 * time.Millisecond},
		},
		{
			name:      "one attempt means no retry",
			policy:    transport.RetryPolicy{MaxAttempts: 1},
			wantErr:   errUpstream,
			wantCalls: 1,
		},
		{
			name:      "success after retries",
			policy:    noJitter,
			results:   []error{errUpstream, errUpstream, nil},
			wantCalls: 3,
			wantWaits: []time.Duration{50 * time.Millisecond, 100 * time.Millisecond},
		},
		{
			name:      "interval capped at MaxInterval",
			policy:    transport.RetryPolicy{MaxAttempts: 8, RandomizationFactor: -1},
			wantErr:   errUpstream,
			wantCalls: 8,
			wantWaits: ms(50, 100, 200, 400, 800, 1000, 1000),
		},
		{
			name:      "Retry-After shorter than backoff is ignored",
			policy:    noJitter,
			hints:     []time.Duration{time.Millisecond},
			results:   []error{errUpstream, nil},
			wantCalls: 2,
			wantWaits: []time.Duration{50 * time.Millisecond},
		},
		{
			name:      "Retry-After at MaxRetryAfter is honoured",
			policy:    noJitter,
			hints:     []time.Duration{5 * time.Second},
			results:   []error{errUpstream, nil},
			wantCalls: 2,
			wantWaits: []time.Duration{5 * time.Second},
		},
		{
			name:      "Retry-After beyond MaxRetryAfter gives up",
			policy:    noJitter,
			hints:     []time.Duration{5*time.Second + 1},
			wantErr:   errUpstream,
			wantCalls: 1,
		},
		{
			name:      "custom MaxRetryAfter",
			policy:    transport.RetryPolicy{MaxRetryAfter: time.Minute, RandomizationFactor: -1},
			hints:     []time.Duration{30 * time.Second},
			results:   []error{errUpstream, nil},
			wantCalls: 2,
			wantWaits: []time.Duration{30 * time.Second},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tm := newInstantTimer()
			calls := 0
			err := transport.Retry(t.Context(), policy(tm, tt.policy), func(attempt int) (time.Duration, error) {
				calls++
				require.Equal(t, calls, attempt)
				var hint time.Duration
				if attempt <= len(tt.hints) {
					hint = tt.hints[attempt-1]
				}
				if attempt <= len(tt.results) {
					return hint, tt.results[attempt-1]
				}
				return hint, errUpstream
			})
			if tt.wantErr == nil {
				assert.NoError(t, err)
			} else {
				assert.Same(t, tt.wantErr, err)
			}
			assert.Equal(t, tt.wantCalls, calls)
			assert.Equal(t, tt.wantWaits, tm.Waits())
		})
	}
}

func TestRetryJitterAndFreshBackoff(t *testing.T) {
	p := transport.RetryPolicy{MaxAttempts: 3}
	for run := range 2 { // a second call starts again from 50ms
		tm := newInstantTimer()
		err := transport.Retry(t.Context(), policy(tm, p), func(int) (time.Duration, error) { return 0, errUpstream })
		require.ErrorIs(t, err, errUpstream)
		waits := tm.Waits()
		require.Len(t, waits, 2, "run %d", run)
		assert.GreaterOrEqual(t, waits[0], 25*time.Millisecond)
		assert.LessOrEqual(t, waits[0], 75*time.Millisecond)
		assert.GreaterOrEqual(t, waits[1], 50*time.Millisecond)
		assert.LessOrEqual(t, waits[1], 150*time.Millisecond)
	}
}

func TestRetryContext(t *testing.T) {
	t.Run("done before the first call", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		cancel()
		called := false
		err := transport.Retry(ctx, transport.RetryPolicy{}, func(int) (time.Duration, error) {
			called = true
			return 0, nil
		})
		assert.ErrorIs(t, err, context.Canceled)
		assert.False(t, called)
	})
	t.Run("cancelled while waiting", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		p := policy(neverTimer{}, transport.RetryPolicy{OnRetry: func(int, error, time.Duration) { cancel() }})
		calls := 0
		err := transport.Retry(ctx, p, func(int) (time.Duration, error) {
			calls++
			return 0, errUpstream
		})
		assert.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, 1, calls)
	})
	t.Run("cancelled during an attempt", func(t *testing.T) {
		ctx, cancel := context.WithCancel(t.Context())
		tm := newInstantTimer()
		calls := 0
		err := transport.Retry(ctx, policy(tm, transport.RetryPolicy{}), func(int) (time.Duration, error) {
			calls++
			cancel()
			return 0, errUpstream
		})
		assert.ErrorIs(t, err, context.Canceled)
		assert.Equal(t, 1, calls)
		assert.Empty(t, tm.Waits())
	})
}

func TestRetryRejectsInvalidPolicy(t *testing.T) {
	tests := []struct {
		name  string
		p     transport.RetryPolicy
		field string
	}{
		{"negative attempts", transport.RetryPolicy{MaxAttempts: -1}, "MaxAttempts"},
		{"negative initial", transport.RetryPolicy{InitialInterval: -1}, "InitialInterval"},
		{"negative max interval", transport.RetryPolicy{MaxInterval: -1}, "MaxInterval"},
		{"multiplier below 1", transport.RetryPolicy{Multiplier: 0.5}, "Multiplier"},
		{"randomization above 1", transport.RetryPolicy{RandomizationFactor: 1.5}, "RandomizationFactor"},
		{"negative max retry-after", transport.RetryPolicy{MaxRetryAfter: -1}, "MaxRetryAfter"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			called := false
			err := transport.Retry(t.Context(), tt.p, func(int) (time.Duration, error) {
				called = true
				return 0, nil
			})
			require.ErrorIs(t, err, transport.ErrInvalidConfig)
			assert.True(t, strings.Contains(err.Error(), tt.field), err.Error())
			assert.False(t, called)
		})
	}
}
