// Package enginepool holds the per-engine state of kvroute's engine pools that
// keeps its own rules: an endpoint's passive health (failures counted,
// ejection with exponential backoff, re-admission), the loop of active
// health probes, what is known of a decode engine's process for restart
// detection (Life) and of an engine's KV layout (Shape). kvroute's
// endpoints hold one Health, Life and Shape each; its pools decide with Eligible which endpoints selection
// considers, its restart check with Life whether a handle may be attached.
package enginepool

import (
	"context"
	"sync"
	"time"

	"github.com/cenkalti/backoff/v4"
)

// Ejection is when an endpoint is ejected, and for how long (kvroute's
// WithHealth: EjectAfter, EjectBackoff, MaxEjectBackoff).
type Ejection struct {
	// After is the consecutive failures that eject; 0 or less: none.
	After             int
	Backoff, MaxDelay time.Duration
}

// Health is one endpoint's passive health state. The zero value is a
// healthy endpoint; it is safe for concurrent use.
type Health struct {
	mu      sync.Mutex
	fails   int
	ejected bool
	until   time.Time
	bo      *backoff.ExponentialBackOff
}

// Eligible reports whether selection may consider the endpoint at now:
// it is not ejected, or its ejection ran out.
func (h *Health) Eligible(now time.Time) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return !h.ejected || !now.Before(h.until)
}

// State returns the consecutive failures and the end of the current or
// last ejection.
func (h *Health) State() (fails int, until time.Time) {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.fails, h.until
}

// Failure counts a failure at now under e and reports an ejection when it
// causes one (on reaching e.After failures, or on failing again after an
// ejection ran out): the failures counted and when it ends.
func (h *Health) Failure(e Ejection, now time.Time) (fails int, until time.Time, ejected bool) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.fails++
	if h.fails < e.After || (h.ejected && now.Before(h.until)) {
		return h.fails, h.until, false
	}
	if h.bo == nil {
		h.bo = backoff.NewExponentialBackOff(
			backoff.WithInitialInterval(e.Backoff),
			backoff.WithMaxInterval(e.MaxDelay),
			backoff.WithMaxElapsedTime(0),
			backoff.WithRandomizationFactor(0.2),
		)
	}
	h.ejected = true
	h.until = now.Add(h.bo.NextBackOff())
	return h.fails, h.until, true
}

// Success resets the state and reports whether the endpoint was ejected.
func (h *Health) Success() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	was := h.ejected
	h.fails, h.ejected = 0, false
	if h.bo != nil {
		h.bo.Reset()
	}
	return was
}

// StartProbes runs round every interval, on one goroutine, until the
// function it returns is called; that function waits for the goroutine
// to end. round gets a context that is cancelled then.
func StartProbes(interval time.Duration, round func(ctx context.Context)) func() error {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		tick := time.NewTicker(interval)
		defer tick.Stop()
		for {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			round(ctx)
		}
	}()
	return func() error {
		cancel()
		<-done
		return nil
	}
}
