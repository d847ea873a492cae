package discovery

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"sync"
	"time"

	"github.com/bidikv/bidikv/transport"
)

// DefaultInterval is how often a Watcher re-resolves its source by
// default: as often as Kubernetes' CoreDNS refreshes its records (its
// default TTL is 5 s).
const DefaultInterval = 5 * time.Second

// WatchStats are a Watcher's counters since NewWatcher.
type WatchStats struct {
	// Refreshes counts resolutions, successful or not.
	Refreshes int64
	// Changes counts endpoint sets handed to the apply function.
	Changes int64
	// Failures counts resolutions that failed (other than ErrNoRecords)
	// and sets the apply function refused; the last good set stayed.
	Failures int64
	// Empty counts answers with no records (ErrNoRecords).
	Empty int64
	// Endpoints is the size of the set last applied.
	Endpoints int
}

// Watcher keeps a consumer's endpoints in step with a Source. It is safe
// for concurrent use.
type Watcher struct {
	src      Source
	apply    func([]transport.Endpoint) error
	interval time.Duration
	timeout  time.Duration
	log      *slog.Logger
	name     string

	mu      sync.Mutex
	applied bool
	last    []string // keys of the set last applied
	failing string   // "" when the last refresh worked, else the kind logged
	stats   WatchStats
}

// WatchOption configures a Watcher.
type WatchOption interface{ apply(*Watcher) }

type watchOptionFunc func(*Watcher)

func (f watchOptionFunc) apply(w *Watcher) { f(w) }

// WithInterval sets the time between refreshes of Run (default
// DefaultInterval); it must be positive.
func WithInterval(d time.Duration) WatchOption {
	return watchOptionFunc(func(w *Watcher) { w.interval = d })
}

// WithTimeout bounds one resolution (default: the interval); it must not
// be negative, and 0 means the interval.
func WithTimeout(d time.Duration) WatchOption {
	return watchOptionFunc(func(w *Watcher) { w.timeout = d })
}

// WithLogger sets the logger of changes and failures (default: none).
// Failures are logged once per run of failures of one kind, and the
// recovery once.
func WithLogger(l *slog.Logger) WatchOption {
	return watchOptionFunc(func(w *Watcher) { w.log = l })
}

// WithName names the pool in logs, e.g. "decode" (default: the source's
// String, when it has one).
func WithName(name string) WatchOption {
	return watchOptionFunc(func(w *Watcher) { w.name = name })
}

// NewWatcher returns a Watcher that hands src's endpoints to apply, for
// example
//
//	func(eps []transport.Endpoint) error { return router.SetEndpoints(kvroute.PhaseDecode, eps...) }
//
// apply is called with the whole set whenever it differs from the one last
// applied (the first time, always), and with an empty set when the source
// answers ErrNoRecords. It is never called concurrently with itself.
// NewWatcher does no network I/O and starts no goroutine.
func NewWatcher(src Source, apply func([]transport.Endpoint) error, opts ...WatchOption) (*Watcher, error) {
	w := &Watcher{src: src, apply: apply, interval: DefaultInterval}
	if s, ok := src.(fmt.Stringer); ok {
		w.name = s.String()
	}
	for _, o := range opts {
		o.apply(w)
	}
	switch {
	case src == nil || apply == nil:
		return nil, fmt.Errorf("%w: NewWatcher needs a source and an apply function", ErrInvalidConfig)
	case w.interval <= 0:
		return nil, fmt.Errorf("%w: WithInterval(%v): the interval must be positive", ErrInvalidConfig, w.interval)
	case w.timeout < 0:
		return nil, fmt.Errorf("%w: WithTimeout(%v): use 0 for the interval", ErrInvalidConfig, w.timeout)
	}
	if w.timeout == 0 {
		w.timeout = w.interval
	}
	if w.log == nil {
		w.log = slog.New(slog.DiscardHandler)
	}
	return w, nil
}

// Run refreshes every interval until ctx is done. It waits one interval
// before the first refresh: call Refresh first for an initial set.
func (w *Watcher) Run(ctx context.Context) {
	t := time.NewTicker(w.interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		_ = w.Refresh(ctx)
	}
}

// Refresh resolves the source once, bounded by the timeout, and applies
// the result if it changed. It returns the resolution's error (one
// wrapping ErrNoRecords after an empty set was applied) or apply's. On any
// error but ErrNoRecords the last good set stays.
func (w *Watcher) Refresh(ctx context.Context) error {
	rctx, cancel := context.WithTimeout(ctx, w.timeout)
	eps, err := w.src.Resolve(rctx)
	cancel()
	w.mu.Lock()
	defer w.mu.Unlock()
	w.stats.Refreshes++
	empty := errors.Is(err, ErrNoRecords)
	switch {
	case empty:
		w.stats.Empty++
		w.failed(ctx, "empty", "discovery: no records; the pool is empty until engines return", err)
		eps = nil
	case err != nil:
		if ctx.Err() != nil {
			return err // stopping: no verdict
		}
		w.stats.Failures++
		w.failed(ctx, "error", "discovery: resolution failed; keeping the last good endpoints", err)
		return err
	}
	keys := make([]string, len(eps))
	for i, ep := range eps {
		keys[i] = ep.String() + " w" + strconv.Itoa(ep.Weight)
	}
	if w.applied && slices.Equal(keys, w.last) {
		if !empty {
			w.recovered(ctx)
		}
		return err
	}
	if aerr := w.apply(eps); aerr != nil {
		w.stats.Failures++
		w.failed(ctx, "apply", "discovery: the endpoints were refused; keeping the last good ones", aerr)
		return aerr
	}
	added, removed := diff(w.last, keys)
	w.log.LogAttrs(ctx, slog.LevelInfo, "discovery: endpoints changed", slog.String("pool", w.name),
		slog.Int("endpoints", len(eps)), slog.Any("added", added), slog.Any("removed", removed))
	w.applied, w.last = true, keys
	w.stats.Changes++
	w.stats.Endpoints = len(eps)
	if !empty {
		w.recovered(ctx)
	}
	return err
}

// failed logs err once per run of failures of one kind.
func (w *Watcher) failed(ctx context.Context, kind, msg string, err error) {
	if w.failing == kind {
		return
	}
	w.failing = kind
	w.log.LogAttrs(ctx, slog.LevelWarn, msg, slog.String("pool", w.name), slog.String("err", err.Error()))
}

func (w *Watcher) recovered(ctx context.Context) {
	if w.failing == "" {
		return
	}
	w.failing = ""
	w.log.LogAttrs(ctx, slog.LevelInfo, "discovery: resolution works again", slog.String("pool", w.name))
}

// Stats returns the Watcher's counters.
func (w *Watcher) Stats() WatchStats {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.stats
}

// diff returns the keys of next not in prev, and of prev not in next.
func diff(prev, next []string) (added, removed []string) {
	for _, k := range next {
		if !slices.Contains(prev, k) {
			added = append(added, k)
		}
	}
	for _, k := range prev {
		if !slices.Contains(next, k) {
			removed = append(removed, k)
		}
	}
	return added, removed
}
