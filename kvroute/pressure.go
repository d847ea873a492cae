package kvroute

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/internal/enginepool"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/kvroute/internal/metricspage"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/retention/budget"
	"golang.org/x/sync/singleflight"
)

// A decode engine's pressure. The router reads each decode engine's
// /metrics when a turn considers the engine and the last reading is older
// than DecodeMemory's MetricsInterval, in the background: its KV capacity
// (vllm:cache_config_info: kv_cache_size_tokens, or num_gpu_blocks less
// vLLM's null block × block_size), the share of its KV memory in use
// (vllm:kv_cache_usage_perc, or vllm:gpu_cache_usage_perc on engines
// before vLLM 0.9; holds count as used), its waiting requests
// (vllm:num_requests_waiting) and its preemptions
// (vllm:num_preemptions_total), for the endpoint's data-parallel rank
// (the samples whose engine label is the rank) or summed over its ranks.
// The capacity sets the engine's budget; the rest is what the Selector
// sees (Candidate), for an engine whose capacity is known (else placement
// is as without the management). The same reading tells the restart check the
// engine's process_start_time_seconds (pressure.go). What was read is kept
// per engine in its decodemem.Pressure.

// press fills c with e's pressure, and has e's metrics read again when
// its reading is stale.
func (m *decodeMemory) press(e *endpoint, c *Candidate) {
	if !m.cfg.on {
		return
	}
	now := m.clock()
	p := e.mem.Snapshot()
	at, last, usage, waiting, preempted, capacity, heldThen := p.At, p.Last, p.Usage, p.Waiting, p.Preempted, p.Capacity, p.Held
	if m.cfg.interval > 0 && (last.IsZero() || now.Sub(last) >= m.cfg.interval || now.Before(last)) {
		m.refresh(e, now)
	}
	if capacity <= 0 {
		capacity = m.cfg.capacity // DecodeMemory's Capacity, for an engine that reports none
	}
	held, budget := m.ledger.Held(e.url, now)
	c.HeldTokens, c.BudgetTokens = held, budget
	if at.IsZero() {
		return // not read yet
	}
	if capacity <= 0 && budget <= 0 {
		return // capacity unknown (its /metrics, Capacity, the Ledger's): placement as before
	}
	if usage >= 0 && capacity > 0 {
		// Holds retained or released since the reading.
		usage = max(usage+float64(held-heldThen)/float64(capacity), 0)
	}
	c.KVUsage, c.Waiting, c.Preempting = max(usage, 0), waiting, preempted
	c.Crowded = preempted || (m.cfg.watermark > 0 && usage >= m.cfg.watermark)
}

// refresh reads e's /metrics in the background, unless a read is running.
func (m *decodeMemory) refresh(e *endpoint, now time.Time) {
	if m.cfg.interval < 0 || !e.mem.Reading.CompareAndSwap(false, true) {
		return
	}
	e.mem.Try(now)
	if !m.bg.run(func(ctx context.Context) {
		defer e.mem.Reading.Store(false)
		if !e.mem.ReadSince(now) { // else read by another's ask since (the meter's)
			_ = m.meter.read(ctx, e)
		}
	}) {
		e.mem.Reading.Store(false)
	}
}

// record records what a reading of e's /metrics, begun at now with the
// ledger holding held tokens on e and the live legs live tokens, tells of
// its pressure. The ledger's holds are those before the engine was asked:
// those retained while it answered are counted on top of its usage
// (press), perhaps twice, never missed. What the engine uses beyond the
// ledger's holds and the live legs is unseen KV (below).
func (m *decodeMemory) record(e *endpoint, now time.Time, held, live int64, page *metricspage.Page) {
	if start := page.Start; e.mem.LenReading.CompareAndSwap(false, true) &&
		!m.bg.run(func(ctx context.Context) { defer e.mem.LenReading.Store(false); readModelLen(ctx, m, e, start) }) {
		e.mem.LenReading.Store(false)
	}
	capacity, bs := e.mem.Record(now, held, live, page)
	if capacity > 0 {
		m.ledger.SetCapacity(e.url, budget.Capacity{Tokens: capacity, BlockSize: bs})
	}
	// Unseen KV (below): over the budget with the ledger's holds, the
	// releaser is nudged; large, it is logged once.
	if u := e.mem.Snapshot().Unseen; u > 0 && capacity > 0 {
		nudgeOver(m, e.url, u)
		if float64(u) >= unseenWarn*float64(capacity) {
			m.log.once(context.Background(), "unseen:"+e.url, "kvroute: a decode engine uses KV memory this router does not account for (another router's holds or requests, streams whose holds carry no handle, orphaned holds): counted as used, so this router's holds yield to it (logged once per engine)",
				slog.String("endpoint", e.url), slog.Int64("unseen_tokens", u), slog.Int64("capacity_tokens", capacity))
		}
	}
}

// nudgeOver has the releaser release holds on engine when they and the
// unseen KV there (below) pass its budget: after a retain (added)
// and after a reading that found unseen KV (record).
func nudgeOver(m *decodeMemory, engine string, unseen int64) {
	if held, b := m.ledger.Held(engine, m.clock()); b > 0 && held > 0 && held+unseen > b {
		m.rel.nudge(engine)
	}
}

// unseenWarn is the share of an engine's capacity in unseen KV from which
// the router warns (once per engine).
const unseenWarn = 0.1

// The engine is the truth. What a decode engine reports in use
// (vllm:kv_cache_usage_perc × its capacity) beyond the ledger's holds and
// the live legs of every Router sharing it at the reading is KV the router does not
// account for: other routers' holds and legs, the holds of streams whose
// answers carry no handle, orphaned holds. A leg of this router's that
// ended before the reading and whose hold the ledger did not count yet
// (its retain was running) is neither: it counts as live at the reading
// (decodemem.Pressure.Begin), since its hold, added after, is counted in
// the ledger, and as unseen KV too it would be counted twice until the
// next reading. It is counted as used where
// the budget and room are decided (memory.go: arrive, room, added), so
// the engine's own usage, not only the ledger, stays within them: the
// router's holds yield to it. DecodeKV.Unseen shows it; from unseenWarn
// of the capacity it is logged, once per engine (record, above).

// capacityUnknown records, after a reading of e's /metrics that answered,
// whether the engine's KV capacity is known, and else why not (why: what
// its /metrics did). Without it the management is off for the engine: its
// holds are kept for the retention TTL and placement ignores its pressure.
// That is counted (Stats.CapacityUnknown), shown (EndpointStatus.
// NoCapacity) and logged once per engine with the fix. An engine that did
// not answer is down, not unknown: its status says so.
func (m *decodeMemory) capacityUnknown(e *endpoint, why string) {
	if m.ledger.Capacity(e.url) > 0 {
		e.mem.SetNoCapacity("")
		return
	}
	why = "its /metrics " + why
	if e.mem.SetNoCapacity(why) {
		m.stats.capacityUnknown.Add(1)
	}
	m.log.once(context.Background(), "no_capacity:"+e.url, "kvroute: a decode engine's KV capacity is unknown: decode memory management is off for it (its holds are kept for the retention TTL, none released for memory); run it with vllm:cache_config_info on its /metrics (log stats on), or set DecodeMemory's Capacity (bidikv-proxy: --decode-kv-capacity) to its KV capacity in tokens (logged once per engine)",
		slog.String("endpoint", e.url), slog.String("reason", why))
}

// One reader of /metrics. Restart detection (pressure.go), pressure (above)
// and block sizes (shape.go) each ask for a reading when theirs is stale;
// the meter reads the engine's /metrics once (the reads of one engine
// asked at once are one request) and hands the page to all three, so that
// each counts the reading as its own and no engine is read twice per
// interval.

// metricsTimeout bounds one GET /metrics (and one GET /v1/models: readModelLen).
const metricsTimeout = 2 * time.Second

// maxMetricsBytes bounds the /metrics page read.
const maxMetricsBytes = 16 << 20

// meter is the Router's one reader of its engines' /metrics.
type meter struct {
	client   *upstream.Client
	clock    func() time.Time
	reads    singleflight.Group // by phase and URL
	restarts *restarts
	shapes   *shapes
	mem      *decodeMemory // nil, or off: no pressure
}

// read reads e's /metrics now, or joins the read of e already running,
// and hands what it tells to restart detection, pressure and block
// sizes. It returns the read's error: nil, an answer other than 2xx
// (*upstream.StatusError) or none. The read is shared: one caller going
// away does not cut it.
func (m *meter) read(ctx context.Context, e *endpoint) error {
	_, err, _ := m.reads.Do(string(e.phase)+" "+e.url, func() (any, error) {
		now := m.clock()
		var held, live int64
		press := m.mem != nil && m.mem.cfg.on && m.mem.cfg.interval >= 0 && e.phase == PhaseDecode // DecodeMemory's readings on
		if press {
			// The legs that ended before their holds are in the ledger
			// count as live: unseen KV (record) is none of them.
			ended := e.mem.Begin(func() {
				held, _ = m.mem.ledger.Held(e.url, now)
				live = m.mem.ledger.Running(e.url, 0) // every Router's sharing the ledger
			})
			live += ended
		}
		var page metricspage.Page
		call := upstream.Call{Path: "/metrics", Timeout: metricsTimeout, Limit: maxMetricsBytes}
		status, err := m.client.Call(context.WithoutCancel(ctx), e.ep, call, func(r io.Reader) error {
			page = metricspage.Parse(r, e.ep.Rank, m.clock())
			return nil
		})
		m.shapes.record(e, page.Size(), err == nil)
		switch {
		case status == 0:
			return nil, err // the readings stay as they were
		case err != nil:
			if e.phase == PhaseDecode {
				m.restarts.answered(e, now, nil)
			}
			if press {
				m.mem.capacityUnknown(e, "could not be read (status "+strconv.Itoa(status)+")")
			}
			return nil, nil
		}
		if e.phase != PhaseDecode {
			return nil, nil
		}
		if len(page.Absurd) > 0 {
			m.restarts.implausible(e.url, page.Absurd)
		}
		m.restarts.answered(e, now, &page)
		if press {
			m.mem.record(e, now, held, live, &page)
			m.mem.capacityUnknown(e, "carry no KV capacity (vllm:cache_config_info)")
		}
		return nil, nil
	})
	return err
}

// maxModelsBytes bounds a GET /v1/models answer.
const maxModelsBytes = 1 << 20

// readModelLen reads e's max_model_len from its GET /v1/models when it is
// unknown or the engine restarted since it was read (start: its
// process_start_time_seconds now, zero when unknown).
func readModelLen(ctx context.Context, m *decodeMemory, e *endpoint, start time.Time) {
	if e.mem.ModelLenKnown(start) {
		return
	}
	var body []byte
	status, err := m.client.Call(ctx, e.ep, upstream.Call{Path: "/v1/models", Timeout: metricsTimeout, Limit: maxModelsBytes}, func(r io.Reader) (err error) {
		body, err = io.ReadAll(r)
		return err
	})
	if err != nil || status != http.StatusOK {
		return
	}
	if n, ok := capability.MaxModelLen(body); ok {
		e.mem.SetModelLen(int64(n), start)
	}
}

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
// how it learns more (pressure.go).
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
