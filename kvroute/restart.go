package kvroute

import (
	"context"
	"errors"
	"log/slog"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/enginepool"
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

// sawEngineID records the engine id (remote_engine_id) of a handle the
// decode engine at url just returned, and reports a restart when it
// differs from the one before.
func (r *restarts) sawEngineID(url, engineID string) {
	ep := r.decode.find(url)
	id := enginepool.BaseEngineID(engineID)
	if ep == nil || id == "" {
		return
	}
	if ep.life.SawEngineID(id) {
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
	if ep.life.OtherID(enginepool.BaseEngineID(kvhandle.EngineIDKnown(e.Handle, e.Blocks))) {
		return MissRestarted
	}
	if r.maxAge > 0 {
		if err := r.readStart(ctx, ep); err != nil {
			r.log.once(ctx, "restart_check:"+ep.url, "kvroute: cannot read a decode engine's /metrics to check it did not restart; its handles are not attached meanwhile",
				slog.String("endpoint", ep.url), slog.String("err", err.Error()))
			return MissEngineUnconfirmed
		}
	}
	if ep.life.StartedAfter(e.Created) {
		// A start after it, or, with no start time to tell a restart
		// from a network failure, a gap after it: the handle may be dead.
		return MissRestarted
	}
	return ""
}

// readStart reads ep's process_start_time_seconds when the last reading is
// older than WithHealth's RestartCheck or predates a failure to reach it; turns
// that need it at once share one request.
func (r *restarts) readStart(ctx context.Context, ep *endpoint) error {
	fresh, unread := ep.life.Fresh(r.clock(), r.maxAge)
	switch {
	case unread:
		return errUnconfirmed
	case fresh:
		return nil
	}
	if err := r.meter.read(ctx, ep); err != nil {
		ep.life.Unreadable(r.clock())
		return err
	}
	if ep.life.NoMetric() {
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
		last := ep.life.Start()
		r.record(ep, now, last, !last.IsZero())
	default:
		r.record(ep, now, page.Start, true)
	}
}

// record records a successful read of ep's /metrics made at now, which
// had process_start_time_seconds start (ok) or none.
func (r *restarts) record(ep *endpoint, now, start time.Time, ok bool) {
	if ep.life.Record(now, start, ok) {
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
	return ep.life.RestartedSince(e.Created, enginepool.BaseEngineID(kvhandle.EngineIDKnown(e.Handle, e.Blocks)))
}
