package kvroute

import (
	"context"
	"io"
	"net/http"
	"time"

	"golang.org/x/sync/singleflight"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/internal/metricspage"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/retention/budget"
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
// engine's process_start_time_seconds (restart.go). What was read is kept
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
// ledger holding held tokens on e, tells of its pressure. The ledger's
// holds are those before the engine was asked: those retained while it
// answered are counted on top of its usage (press), perhaps twice, never
// missed.
func (m *decodeMemory) record(e *endpoint, now time.Time, held int64, page *metricspage.Page) {
	if start := page.Start; e.mem.LenReading.CompareAndSwap(false, true) &&
		!m.bg.run(func(ctx context.Context) { defer e.mem.LenReading.Store(false); readModelLen(ctx, m, e, start) }) {
		e.mem.LenReading.Store(false)
	}
	capacity, bs := e.mem.Record(now, held, page)
	if capacity > 0 {
		m.ledger.SetCapacity(e.url, budget.Capacity{Tokens: capacity, BlockSize: bs})
	}
}

// One reader of /metrics. Restart detection (restart.go), pressure (above)
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
		var held int64
		press := m.mem != nil && m.mem.cfg.on && m.mem.cfg.interval >= 0 && e.phase == PhaseDecode // DecodeMemory's readings on
		if press {
			held, _ = m.mem.ledger.Held(e.url, now)
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
			m.mem.record(e, now, held, &page)
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
