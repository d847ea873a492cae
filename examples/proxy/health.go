package main

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/transport"
)

// Engine roles, as labels in metrics and logs.
const (
	rolePrefill = "prefill"
	roleDecode  = "decode"
)

// engine is one upstream engine and what its last health probe said.
type engine struct {
	role, url string
	up        atomic.Bool
	probed    atomic.Bool // up has been set at least once
	// reason is why the last probe found the engine down ("" when up).
	reason atomic.Pointer[string]
	// caps is the engine's last capability report (nil before the first
	// probe that reached it); logged is the summary last logged.
	caps   atomic.Pointer[capability.Report]
	logged string // the health loop's only
}

// health probes the engines' GET /health and, in its loop, their
// capabilities (kvroute/capability).
type health struct {
	client   *http.Client
	mu       sync.Mutex // guards engines, which DNS discovery replaces (setEngines)
	engines  []*engine
	timeout  time.Duration
	log      *slog.Logger
	onChange func(e *engine, up bool) // called on every change, and on the first probe
	// capOpts are the capability probe's options (the engines' API key);
	// onCaps is called after a round in which a report changed, with
	// every engine's facts.
	capOpts []capability.Option
	onCaps  func([]engineFacts)
	// status returns the router's view of an engine (nil: none): what its
	// turns showed (EndpointStatus.Learned, laid over each probe's
	// report), its block size and whether it serves without reuse.
	status func(role, url string) *kvroute.EndpointStatus
}

func newHealth(client *http.Client, prefill, decode []string, timeout time.Duration, log *slog.Logger) *health {
	h := &health{client: client, timeout: timeout, log: log}
	for _, u := range prefill {
		h.engines = append(h.engines, &engine{role: rolePrefill, url: strings.TrimRight(u, "/")})
	}
	for _, u := range decode {
		h.engines = append(h.engines, &engine{role: roleDecode, url: strings.TrimRight(u, "/")})
	}
	return h
}

// check probes every engine at once and reports whether at least one
// prefill and one decode engine answered 200.
func (h *health) check(ctx context.Context) (prefillUp, decodeUp bool) {
	engines := h.list()
	var wg sync.WaitGroup
	for _, e := range engines {
		wg.Go(func() { h.probe(ctx, e) })
	}
	wg.Wait()
	for _, e := range engines {
		if e.up.Load() {
			prefillUp = prefillUp || e.role == rolePrefill
			decodeUp = decodeUp || e.role == roleDecode
		}
	}
	return prefillUp, decodeUp
}

func (h *health) probe(parent context.Context, e *engine) {
	ctx, cancel := context.WithTimeout(parent, h.timeout)
	defer cancel()
	up, why := false, ""
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.url+"/health", nil)
	if err == nil {
		var resp *http.Response
		if resp, err = h.client.Do(req); err == nil {
			_, _ = io.Copy(io.Discard, io.LimitReader(resp.Body, 4096))
			_ = resp.Body.Close()
			up = resp.StatusCode == http.StatusOK
			if !up {
				why = "GET /health answered " + resp.Status
			}
		}
	}
	if err != nil {
		why = "GET /health: " + err.Error()
		if errors.Is(err, context.DeadlineExceeded) {
			why = "GET /health: no answer within --health-timeout " + h.timeout.String()
		}
	}
	if !up && parent.Err() != nil {
		return // the caller went away: no verdict
	}
	e.reason.Store(&why)
	was := e.up.Swap(up)
	first := !e.probed.Swap(true)
	if first || was != up {
		if !first || !up {
			level := slog.LevelInfo
			attrs := []slog.Attr{slog.String("role", e.role), slog.String("endpoint", e.url), slog.Bool("up", up)}
			if !up {
				level = slog.LevelWarn
				attrs = append(attrs, slog.String("reason", why))
			}
			h.log.LogAttrs(ctx, level, "engine health changed", attrs...)
		}
		if h.onChange != nil {
			h.onChange(e, up)
		}
	}
}

// run probes every interval until ctx is done: health, then capabilities.
func (h *health) run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		h.check(ctx)
		h.refreshCaps(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// refreshCaps brings the capability report of every engine that is up
// to date (capability.Refresh: one /metrics read; a full probe for an
// engine seen for the first time, back after a failure, or restarted), logs
// one line per engine whose summary changed, and calls onCaps when any did.
func (h *health) refreshCaps(ctx context.Context) {
	engines := h.list()
	changed := make([]bool, len(engines))
	var wg sync.WaitGroup
	for i, e := range engines {
		if !e.up.Load() {
			continue
		}
		wg.Go(func() { changed[i] = h.refreshEngine(ctx, e) })
	}
	wg.Wait()
	if ctx.Err() != nil || !slices.Contains(changed, true) || h.onCaps == nil {
		return
	}
	h.onCaps(h.facts())
}

// refreshEngine refreshes e's report and reports whether its summary
// changed (logging it).
func (h *health) refreshEngine(ctx context.Context, e *engine) bool {
	ep, err := transport.ParseEndpoint(e.url)
	if err != nil {
		return false
	}
	rep, _ := capability.Refresh(ctx, h.client.Transport, ep, e.caps.Load(), h.capOpts...)
	if ctx.Err() != nil {
		return false
	}
	if h.status != nil && rep.Reachable {
		if st := h.status(e.role, e.url); st != nil && len(st.Learned) > 0 {
			fs := st.Learned
			// What turns showed stays in the report until a restart
			// (Refresh probes a restarted engine afresh, and the router
			// forgets what it learned of it).
			next := *rep
			for _, n := range fs {
				next.Learn(n.Name, n.Fact)
			}
			rep = &next
		}
	}
	e.caps.Store(rep)
	sum := rep.Summary()
	if sum == e.logged {
		return false
	}
	e.logged = sum
	level := slog.LevelInfo
	if !rep.Reachable {
		level = slog.LevelWarn
	}
	h.log.LogAttrs(ctx, level, "engine capabilities", slog.String("role", e.role), slog.String("endpoint", e.url),
		slog.String("summary", sum))
	return true
}

// down returns why e's last probe found it down ("" when up or not probed).
func (e *engine) down() string {
	if p := e.reason.Load(); p != nil && !e.up.Load() {
		return *p
	}
	return ""
}

// facts returns every engine's role, URL and last report.
func (h *health) facts() []engineFacts {
	engines := h.list()
	out := make([]engineFacts, len(engines))
	for i, e := range engines {
		out[i] = engineFacts{role: e.role, url: e.url, rep: e.caps.Load()}
		if h.status != nil {
			out[i].status = h.status(e.role, e.url)
		}
	}
	return out
}

// ordered returns the engines last seen up first, decode before prefill.
func (h *health) ordered() []*engine {
	engines := h.list()
	out := make([]*engine, 0, len(engines))
	for _, pass := range []func(e *engine) bool{
		func(e *engine) bool { return e.up.Load() && e.role == roleDecode },
		func(e *engine) bool { return e.up.Load() && e.role == rolePrefill },
		func(e *engine) bool { return !e.up.Load() },
	} {
		for _, e := range engines {
			if pass(e) {
				out = append(out, e)
			}
		}
	}
	return out
}

// list returns the current engines; the caller must not modify it.
func (h *health) list() []*engine {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.engines
}

// setEngines replaces the engines of role with urls, keeping the state of
// those that stay, and returns those removed.
func (h *health) setEngines(role string, urls []string) (removed []*engine) {
	h.mu.Lock()
	defer h.mu.Unlock()
	next := make([]*engine, 0, len(h.engines)+len(urls))
	keep := map[string]*engine{}
	for _, e := range h.engines {
		if e.role != role {
			next = append(next, e)
		} else {
			keep[e.url] = e
		}
	}
	for _, u := range urls {
		u = strings.TrimRight(u, "/")
		if e, ok := keep[u]; ok {
			next = append(next, e)
			delete(keep, u)
			continue
		}
		next = append(next, &engine{role: role, url: u})
	}
	for _, e := range keep {
		removed = append(removed, e)
	}
	h.engines = next
	return removed
}
