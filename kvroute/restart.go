package kvroute

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/kvroute/internal/metricspage"
)

// Decode engine restarts. A decode engine that restarted no longer holds
// the blocks its handles name: P's read fails (vLLM's default random
// engine id: P's handshake finds another id) or, with an engine id fixed
// in kv_transfer_config, silently returns whatever the new process keeps
// in those block ids, a wrong answer. So no handle is attached unless the
// router knows its decode engine has not restarted since the handle was
// issued. It learns that from three signals:
//
//   - the engine's process_start_time_seconds on GET /metrics (the
//     Prometheus process collector vLLM's API server registers; a restart
//     changes it), read again before a handle is attached when the last
//     read is older than WithHealth's RestartCheck (default 1 s, far below the time
//     a vLLM restart takes to load its model) or when the engine could
//     not be reached since: a handle created before the engine's start is
//     not attached (MissRestarted);
//   - the engine id in its handles: a handle whose remote_engine_id
//     (without vLLM's data-parallel suffix "_dp<k>") differs from the
//     latest one the engine returned is from another process;
//   - a failure to reach the engine (a refused or broken connection, a
//     failed probe): on an engine that serves no process_start_time_seconds
//     (vLLM with several API server processes), every handle it issued
//     before the failure is treated as issued before a restart.
//
// Engine start times are compared with the router's clock, so the two
// must agree (NTP) to well within the time an engine takes to start.

// restarts is what the Router knows of its decode engines' processes, and
// how it learns more (restart.go).
type restarts struct {
	decode *pool
	meter  *meter        // the one reader of /metrics (pressure.go)
	maxAge time.Duration // WithRestartCheck
	clock  func() time.Time
	stats  *counters
	log    *logger
	forget func(url string) // drops what turns showed of a restarted engine (learned.go)
}

// life is what the router knows of one decode engine's process.
type life struct {
	mu       sync.Mutex
	engineID string    // the engine id of its latest handle, without "_dp<k>"
	start    time.Time // process_start_time_seconds; zero when unknown
	checked  time.Time // when /metrics was last read (router clock); zero: never
	gap      time.Time // the last failure to reach the engine; zero: none
	noMetric bool      // its last /metrics had no process_start_time_seconds
	// unread: the last read of /metrics failed, at checked; it is not
	// tried again (and the engine's handles are not attached) until the
	// reading is as old as WithHealth's RestartCheck, so that an engine that does
	// not answer costs one read per interval, not one per turn.
	unread bool
}

// markGap records a failure to reach the engine at now.
func (l *life) markGap(now time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if now.After(l.gap) {
		l.gap = now
	}
}

// baseEngineID strips vLLM's data-parallel suffix "_dp<k>" from id: the
// ranks of one engine share the rest, which a restart changes.
func baseEngineID(id string) string {
	for i := len(id) - 1; i >= 0; i-- {
		c := id[i]
		if c >= '0' && c <= '9' {
			continue
		}
		if i < len(id)-1 && i > 2 && id[i-2:i+1] == "_dp" {
			return id[:i-2]
		}
		break
	}
	return id
}

// sawEngineID records the engine id (remote_engine_id) of a handle the
// decode engine at url just returned, and reports a restart when it
// differs from the one before.
func (r *restarts) sawEngineID(url, engineID string) {
	ep := r.decode.find(url)
	id := baseEngineID(engineID)
	if ep == nil || id == "" {
		return
	}
	l := &ep.life
	l.mu.Lock()
	prev := l.engineID
	l.engineID = id
	l.mu.Unlock()
	if prev != "" && prev != id {
		r.restarted(url, "a new engine id in its handles")
	}
}

// restarted counts and logs (once per endpoint) a restart the router
// noticed.
func (r *restarts) restarted(url, how string) {
	r.stats.decodeRestarts.Add(1)
	if r.forget != nil {
		r.forget(url) // it may run another build now
	}
	r.log.once(context.Background(), "restart:"+url, "kvroute: a decode engine restarted; the handles it issued before are never attached",
		slog.String("endpoint", url), slog.String("noticed_by", how))
}

// errUnconfirmed: the engine's process could not be read.
var errUnconfirmed = errors.New("kvroute: the decode engine's process start could not be read")

// check decides whether e's decode engine may still hold e's
// blocks: "" when nothing says it restarted since e was created,
// MissRestarted when something does (e must not be attached, nor kept),
// MissEngineUnconfirmed when the engine could not be reached to tell (e is
// not attached now but may be later).
func (r *restarts) check(ctx context.Context, e *entry.Entry) MissReason {
	ep := r.decode.find(e.Endpoint)
	if ep == nil {
		return "" // MissEndpointGone's business
	}
	l := &ep.life
	id := baseEngineID(kvhandle.EngineIDKnown(e.Handle, e.Blocks))
	l.mu.Lock()
	known := l.engineID
	l.mu.Unlock()
	if known != "" && id != "" && id != known {
		return MissRestarted
	}
	if r.maxAge > 0 {
		if err := r.readStart(ctx, ep); err != nil {
			r.log.once(ctx, "restart_check:"+ep.url, "kvroute: cannot read a decode engine's /metrics to check it did not restart; its handles are not attached meanwhile",
				slog.String("endpoint", ep.url), slog.String("err", err.Error()))
			return MissEngineUnconfirmed
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if !l.start.IsZero() && e.Created.Before(l.start) {
		return MissRestarted
	}
	if (l.start.IsZero() || l.noMetric) && !l.gap.IsZero() && e.Created.Before(l.gap) {
		// No start time to tell a restart from a network failure: a
		// handle from before the engine was unreachable may be dead.
		return MissRestarted
	}
	return ""
}

// readStart reads ep's process_start_time_seconds when the last reading is
// older than WithHealth's RestartCheck or predates a failure to reach it; turns
// that need it at once share one request.
func (r *restarts) readStart(ctx context.Context, ep *endpoint) error {
	now := r.clock()
	l := &ep.life
	l.mu.Lock()
	recent := !l.checked.IsZero() && now.Sub(l.checked) < r.maxAge
	fresh, unread := recent && !l.gap.After(l.checked), recent && l.unread
	l.mu.Unlock()
	switch {
	case unread:
		return errUnconfirmed
	case fresh:
		return nil
	}
	if err := r.meter.read(ctx, ep); err != nil {
		l.mu.Lock()
		l.checked, l.unread = r.clock(), true
		if l.checked.After(l.gap) {
			l.gap = l.checked
		}
		l.mu.Unlock()
		return err
	}
	l.mu.Lock()
	none := l.noMetric
	l.mu.Unlock()
	if none {
		r.noStartMetric(ep.url)
	}
	return nil
}

// answered records what a read of ep's /metrics begun at now found: page,
// or nil when the engine answered other than 2xx. Whoever asked for the
// reading (the check, pressure or block sizes: the meter, pressure.go),
// it is the check's own: made at now, as fresh as the check's reading
// would be.
func (r *restarts) answered(ep *endpoint, now time.Time, page *metricspage.Page) {
	if r.maxAge <= 0 {
		return
	}
	switch {
	case page == nil || (page.Start.IsZero() && !page.BadStart):
		r.record(ep, now, time.Time{}, false)
	case page.BadStart:
		// The last plausible start stands (none: as if the engine
		// served no start time).
		ep.life.mu.Lock()
		last := ep.life.start
		ep.life.mu.Unlock()
		r.record(ep, now, last, !last.IsZero())
	default:
		r.record(ep, now, page.Start, true)
	}
}

// record records a successful read of ep's /metrics made at now, which
// had process_start_time_seconds start (ok) or none.
func (r *restarts) record(ep *endpoint, now, start time.Time, ok bool) {
	l := &ep.life
	l.mu.Lock()
	if now.Before(l.checked) {
		l.mu.Unlock()
		return // a later reading is already recorded
	}
	l.checked, l.unread = now, false
	l.noMetric = !ok
	changed := false
	if ok {
		changed = !l.start.IsZero() && !start.Equal(l.start)
		l.start = start
		if !l.gap.After(now) {
			l.gap = time.Time{} // the reading explains the gap
		}
	}
	l.mu.Unlock()
	if changed {
		r.restarted(ep.url, "process_start_time_seconds")
	}
}

// implausible counts a reading of the decode engine at url's /metrics with
// values plausible.Check refused (each as plausible.Reading writes it),
// ignored for the last good ones, and logs each metric once per endpoint.
func (r *restarts) implausible(url string, readings []string) {
	r.stats.implausibleMetrics.Add(1)
	for _, v := range readings {
		name, _, _ := strings.Cut(v, "=")
		r.log.once(context.Background(), "implausible:"+name+":"+url, "kvroute: a decode engine's /metrics reports an implausible value; it is ignored and the last plausible one kept",
			slog.String("endpoint", url), slog.String("value", v))
	}
}

// noStartMetric logs once per endpoint that its /metrics has no
// process_start_time_seconds.
func (r *restarts) noStartMetric(url string) {
	r.stats.restartChecksUnavailable.Add(1)
	r.log.once(context.Background(), "no_start_metric:"+url, "kvroute: a decode engine's /metrics has no process_start_time_seconds (vLLM with several API server processes?); its restarts are noticed only by a new engine id or a failure to reach it",
		slog.String("endpoint", url))
}

// restartedSince reports whether what the router already knows, without
// asking, says e's decode engine restarted since e was made (another
// engine id in its handles, or a process start after e): its blocks are
// gone, a release is pointless (Stats.ReleaseSkipped).
func (r *restarts) restartedSince(e *entry.Entry) bool {
	ep := r.decode.find(e.Endpoint)
	if ep == nil {
		return false
	}
	l := &ep.life
	id := baseEngineID(kvhandle.EngineIDKnown(e.Handle, e.Blocks))
	l.mu.Lock()
	defer l.mu.Unlock()
	return (l.engineID != "" && id != "" && id != l.engineID) || (!l.start.IsZero() && e.Created.Before(l.start))
}
