package main

import (
	"errors"
	"math"
	"net/http"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
)

const namespace = "bidikv"

// metrics are the proxy's Prometheus collectors, in a registry of their
// own (never the global one).
type metrics struct {
	reg *prometheus.Registry

	turns     *prometheus.CounterVec // path, reuse, result
	hits      prometheus.Counter
	misses    *prometheus.CounterVec // reason
	errors    *prometheus.CounterVec // phase
	stored    prometheus.Counter
	refusals  *prometheus.CounterVec // reason
	fallbacks prometheus.Counter
	bytes     prometheus.Counter
	missing   *prometheus.CounterVec // reason, path: turns a missing engine capability cost
	buffered  *prometheus.CounterVec // path: buffered streams (--decode-stream buffered)

	ttft      *prometheus.HistogramVec // reuse
	prefill   *prometheus.HistogramVec // reuse
	firstByte *prometheus.HistogramVec // reuse
	duration  *prometheus.HistogramVec // reuse
	handleAge prometheus.Histogram
	reusable  prometheus.Histogram
	estimate  *prometheus.HistogramVec // path: observed TTFT over the cost model's estimate

	rejected *prometheus.CounterVec // status, reason
	lookedUp struct {
		mu         sync.Mutex
		hits, miss int64
	}

	inflight   prometheus.Gauge
	stalled    prometheus.Counter
	endpointUp *prometheus.GaugeVec // role, endpoint

	fields *fieldFamilies // the record's other fields, from its turn tags
}

func newMetrics() *metrics {
	seconds := prometheus.ExponentialBuckets(0.005, 2, 14) // 5 ms to 41 s
	m := &metrics{
		reg: prometheus.NewRegistry(),
		turns: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "turns_total",
			Help: "Turns that reached lookup, by path, reuse outcome (hit, miss, off) and result (ok, error); requests rejected before are in rejected_requests_total."},
			[]string{"path", "reuse", "result"}),
		hits: prometheus.NewCounter(prometheus.CounterOpts{Namespace: namespace, Name: "reuse_hits_total",
			Help: "Turns whose prefill leg carried a retained decode handle."}),
		misses: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "reuse_misses_total",
			Help: "Turns without a usable retained handle, by reason (no_key, not_found, expired, threshold, store_error, bad_entry, retry, mismatch, unverified, partial_refused)."},
			[]string{"reason"}),
		errors: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "turn_errors_total",
			Help: "Turns that ended with an error, by phase (lookup, prefill, decode, stream)."},
			[]string{"phase"}),
		stored: prometheus.NewCounter(prometheus.CounterOpts{Namespace: namespace, Name: "handles_stored_total",
			Help: "Decode handles retained for a next turn."}),
		refusals: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "store_refusals_total",
			Help: "Finished turns whose handle was not retained, by reason."},
			[]string{"reason"}),
		fallbacks: prometheus.NewCounter(prometheus.CounterOpts{Namespace: namespace, Name: "local_prefill_fallbacks_total",
			Help: "Turns the decode engine prefilled locally because the prefill engine returned no handle."}),
		missing: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "missing_capability_turns_total",
			Help: "Turns that reused or retained less than they could because an engine lacks a capability, by reason (no_render_route, no_stream_handle, no_api_handle, no_token_ids, no_bidirectional) and API path; /ready and bidikv-proxy doctor name the fix."},
			[]string{"reason", "path"}),
		buffered: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "buffered_streams_total",
			Help: "Streamed turns whose decode leg ran non-streaming and whose answer was sent as the API's stream once complete (--decode-stream buffered), by API path."},
			[]string{"path"}),
		bytes: prometheus.NewCounter(prometheus.CounterOpts{Namespace: namespace, Name: "response_bytes_total",
			Help: "Response bytes handed to clients."}),
		ttft: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: namespace, Name: "ttft_seconds",
			Help: "Time from the request to the first response event handed to the client.", Buckets: seconds},
			[]string{"reuse"}),
		prefill: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: namespace, Name: "prefill_seconds",
			Help: "Duration of the prefill leg, request to the prefill engine's answer.", Buckets: seconds},
			[]string{"reuse"}),
		firstByte: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: namespace, Name: "decode_first_byte_seconds",
			Help: "Time from the decode request to the decode engine's response headers.", Buckets: seconds},
			[]string{"reuse"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: namespace, Name: "turn_duration_seconds",
			Help: "Time from the request to the end of the turn.", Buckets: seconds},
			[]string{"reuse"}),
		handleAge: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: namespace, Name: "handle_age_seconds",
			Help: "Age of the retained handle attached on a hit.", Buckets: prometheus.ExponentialBuckets(0.1, 2, 13)}),
		reusable: prometheus.NewHistogram(prometheus.HistogramOpts{Namespace: namespace, Name: "reusable_tokens",
			Help: "Tokens the attached handle lets the prefill engine read on a hit (remote_num_tokens, or the verified prefix).", Buckets: prometheus.ExponentialBuckets(64, 2, 12)}),
		estimate: prometheus.NewHistogramVec(prometheus.HistogramOpts{Namespace: namespace, Name: "ttft_over_estimate_ratio",
			Help: "Observed TTFT over the cost model's estimate of the engines' part (--decode-local), by chosen path; above 1 includes render and the router's own work.", Buckets: []float64{0.25, 0.5, 0.8, 0.9, 1, 1.1, 1.25, 1.5, 2, 4}},
			[]string{"path"}),
		rejected: prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "rejected_requests_total",
			Help: "Requests answered with an error before a turn reached lookup (not counted as turns), by status and reason: bad_request, too_large, unauthorized, not_found, method_not_allowed, http_version, headers_too_large, body_timeout, body_too_slow, ambiguous_length, overloaded_turns, overloaded_bytes, overloaded_answer_bytes, overloaded_bodies, overloaded_client_bodies, closed."},
			[]string{"status", "reason"}),
		inflight: prometheus.NewGauge(prometheus.GaugeOpts{Namespace: namespace, Name: "inflight_turns",
			Help: "Completion requests being served now (bodies in transit excluded; bounded by --max-concurrent-turns)."}),
		stalled: prometheus.NewCounter(prometheus.CounterOpts{Namespace: namespace, Name: "stalled_clients_total",
			Help: "Turns cut because their client stopped reading: a write blocked, or bytes stayed unacknowledged, beyond --client-write-timeout."}),
		endpointUp: prometheus.NewGaugeVec(prometheus.GaugeOpts{Namespace: namespace, Name: "endpoint_up",
			Help: "1 when the engine's last /health probe answered 200, else 0."},
			[]string{"role", "endpoint"}),
		fields: newFieldFamilies(seconds),
	}
	m.reg.MustRegister(m.fields.collectors()...)
	m.reg.MustRegister(m.turns, m.hits, m.misses, m.errors, m.stored, m.refusals, m.fallbacks, m.bytes, m.missing, m.buffered,
		m.ttft, m.prefill, m.firstByte, m.duration, m.handleAge, m.reusable, m.estimate, m.inflight, m.stalled, m.endpointUp, m.rejected,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: "reuse_hit_ratio",
			Help: "Hits (decode-local turns included) over hits and misses since start, over turns that reached lookup (rejected requests and reuse off excluded); NaN before the first."},
			m.hitRatio),
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// watchRouter exports the router's own counters.
func (m *metrics) watchRouter(r *kvroute.Router) {
	stat := func(name, help string, get func(kvroute.Stats) int64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help},
			func() float64 { return float64(get(r.Stats())) })
	}
	m.reg.MustRegister(
		stat("stream_without_handle_total", "Streaming turns whose decode engine's stream ended without a handle (chat and completions without vLLM PR #40186, Messages always): nothing to reuse; per API in bidikv_missing_capability_turns_total{reason=\"no_stream_handle\"}; --decode-stream buffered avoids them.",
			func(s kvroute.Stats) int64 { return s.NoStreamHandle }),
		stat("prefill_without_handle_total", "Prefill answers without a usable handle.",
			func(s kvroute.Stats) int64 { return s.NoPrefillHandle }),
		stat("hit_retries_total", "Prefill attempts with a handle that failed and were retried as plain misses.",
			func(s kvroute.Stats) int64 { return s.HitRetries }),
		stat("store_errors_total", "Store failures; each turn went on as a miss.",
			func(s kvroute.Stats) int64 { return s.StoreErrors }),
		stat("render_calls_total", "Render (or tokenize) calls made to verify reuse by tokens.",
			func(s kvroute.Stats) int64 { return s.Renders }),
		stat("render_failures_total", "Render calls that failed; such turns ran without the handle unless content rules could verify it.",
			func(s kvroute.Stats) int64 { return s.RenderFailures }),
		stat("token_fallbacks_total", "Turns that fell back from token to content verification (no render endpoint, or no token ids from the decode engine).",
			func(s kvroute.Stats) int64 { return s.TokenFallbacks }),
		stat("partial_hits_total", "Hits that attached only a verified prefix of a handle.",
			func(s kvroute.Stats) int64 { return s.PartialHits }),
		stat("partial_refused_total", "Handles that matched only in part and could not be cut (dcp_size > 1, unequal KV groups, --block-size mismatch).",
			func(s kvroute.Stats) int64 { return s.PartialRefused }),
		stat("handle_put_backs_total", "Handles taken for verification, not attached, and returned to the store.",
			func(s kvroute.Stats) int64 { return s.PutBacks }),
		stat("decode_without_handle_total", "Decode answers that finished normally without a handle although one was expected (the engine lost bidirectional transfer).",
			func(s kvroute.Stats) int64 { return s.NoDecodeHandle }),
		stat("unconfirmed_hits_total", "Hits whose prefill answer reported fewer cached tokens than were attached (the engine did not use the handle).",
			func(s kvroute.Stats) int64 { return s.UnconfirmedHits }),
		stat("push_handles_total", "Handles with transfer_mode push, which cannot be used bidirectionally.",
			func(s kvroute.Stats) int64 { return s.PushHandles }),
		stat("handles_too_large_total", "Handles not retained because their entry is over a size bound.",
			func(s kvroute.Stats) int64 { return s.TooLarge }),
		stat("decode_local_busy_total", "Turns estimated cheapest decode-local that pulled because their decode engine ran its maximum of decode-local prefills.",
			func(s kvroute.Stats) int64 { return s.LocalBusy }),
		stat("cpu_tier_pulls_total", "Turns whose prefill leg pulled the conversation's history from its last decode engine's CPU tier (--cpu-tier-tokens: no decode hold to attach, and the pull estimated cheaper than recomputing); a pull that finds the tier evicted costs a recompute, never a wrong answer.",
			func(s kvroute.Stats) int64 { return s.PeerPulls }),
		stat("cpu_tier_skipped_total", "Turns with a CPU tier record that did not pull from it: too little of the conversation estimated still there to beat a recompute, or its decode engine ejected or gone.",
			func(s kvroute.Stats) int64 { return s.PeerSkipped }),
		stat("cpu_tier_short_total", "CPU tier pulls whose prefill engine reported fewer cached tokens than the tier was estimated to hold (engines with --enable-prompt-tokens-details): the tier evicts sooner than --cpu-tier-tokens says, or pulls miss (hash seed, block size, port: run doctor --cpu-tier --probe).",
			func(s kvroute.Stats) int64 { return s.PeerShort }),
		stat("cpu_tier_local_short_total", "Decode-local turns chosen on the estimate that the decode engine's CPU tier held the conversation, whose decode engine then reported fewer cached tokens than estimated (engines with --enable-prompt-tokens-details): the reload missed and the decode engine computed the history itself; the tier evicts sooner than --cpu-tier-tokens says (run doctor --cpu-tier --probe).",
			func(s kvroute.Stats) int64 { return s.LocalShort }),
		stat("decode_local_failures_total", "Decode-local legs that failed before any byte reached the client; each turn ran again as a plain miss.",
			func(s kvroute.Stats) int64 { return s.LocalFailures }),
		stat("invalid_handles_total", "KV handles refused because vLLM could not read them correctly (block ids, port, counts, types, duplicate members).",
			func(s kvroute.Stats) int64 { return s.InvalidHandles }),
		stat("unvalidated_handles_total", "KV handles (among invalid_handles_total) with fewer blocks than their engine's block size needs: the turn was served without reuse and the engine serves without reuse for a while (/ready no_reuse); the engine reports a block size its handles do not follow, or --block-size is not the engine's.",
			func(s kvroute.Stats) int64 { return s.UnvalidatedHandles }),
		stat("restarted_handles_total", "Retained handles dropped because their decode engine restarted since it issued them.",
			func(s kvroute.Stats) int64 { return s.RestartedHandles }),
		stat("decode_restarts_total", "Decode engine restarts noticed (a new process_start_time_seconds or engine id).",
			func(s kvroute.Stats) int64 { return s.DecodeRestarts }),
		stat("restart_checks_unavailable_total", "Reads of a decode engine's /metrics without process_start_time_seconds.",
			func(s kvroute.Stats) int64 { return s.RestartChecksUnavailable }),
		stat("implausible_engine_metrics_total", "Readings of a decode engine's /metrics (pressure, restart checks) with a value no real engine reports (an overflowed count, a capacity below one block, a usage outside 0 to 1, a process start in the future): ignored, the last plausible value kept; logged once per engine and metric.",
			func(s kvroute.Stats) int64 { return s.ImplausibleMetrics }),
		stat("decode_kv_capacity_unknown_total", "Decode engines whose /metrics answered without a KV capacity (no vllm:cache_config_info, or not 200) while --decode-kv-capacity is 0: decode memory management is off for them (named in /ready's no_capacity); logged once per engine. Set --decode-kv-capacity to their KV capacity in tokens.",
			func(s kvroute.Stats) int64 { return s.CapacityUnknown }),
		stat("render_breaks_total", "Openings of a prefill engine's render circuit breaker (consecutive failures, or a call that ran out of --render-timeout).",
			func(s kvroute.Stats) int64 { return s.RenderBreaks }),
		stat("render_skipped_total", "Turns that went on without a render because every prefill engine's renderer was behind an open breaker or distrusted.",
			func(s kvroute.Stats) int64 { return s.RenderSkipped }),
		stat("render_mismatches_total", "Prefill legs whose engine computed other prompt tokens than its render answered (the renderer is distrusted; a wrong pull is redone as a plain miss).",
			func(s kvroute.Stats) int64 { return s.RenderMismatches }),
		stat("unchecked_prefills_total", "Prefill legs with a handle whose answer carried no prompt_token_ids to check.",
			func(s kvroute.Stats) int64 { return s.UncheckedPrefills }),
		stat("avoided_engine_turns_total", "Turns that kept off a prefill engine whose prefix cache may hold KV pulled for a mismatched prompt of their conversation.",
			func(s kvroute.Stats) int64 { return s.AvoidedEngineTurns }),
	)
	m.statsByLabel(r, "path_decisions_total", "The cost model's decisions by path (--decode-local): pull the retained KV to P, answer on the decode engine that holds the conversation, or recompute on P.",
		"path", []labeledStat{
			{"pull", func(s kvroute.Stats) int64 { return s.ChosePull }},
			{"decode_local", func(s kvroute.Stats) int64 { return s.ChoseLocal }},
			{"recompute", func(s kvroute.Stats) int64 { return s.ChoseRecompute }},
		})
	m.reg.MustRegister(decodeKVCollector{r: r})
}

var (
	kvTokensDesc = prometheus.NewDesc(namespace+"_decode_kv_held_tokens",
		"KV tokens each decode engine holds for this proxy's live retained handles (the memory the retention TTL trades against the hit rate).",
		[]string{"endpoint"}, nil)
	kvBytesDesc = prometheus.NewDesc(namespace+"_decode_kv_held_bytes",
		"decode_kv_held_tokens × --kv-bytes-per-token (0 when that is unset).", []string{"endpoint"}, nil)
	kvHandlesDesc = prometheus.NewDesc(namespace+"_decode_kv_held_handles",
		"Live retained handles per decode engine.", []string{"endpoint"}, nil)
)

// decodeKVCollector exports Router.DecodeKV at each scrape.
type decodeKVCollector struct{ r *kvroute.Router }

// Describe implements prometheus.Collector.
func (c decodeKVCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- kvTokensDesc
	ch <- kvBytesDesc
	ch <- kvHandlesDesc
}

// Collect implements prometheus.Collector.
func (c decodeKVCollector) Collect(ch chan<- prometheus.Metric) {
	for _, kv := range c.r.DecodeKV() {
		ch <- prometheus.MustNewConstMetric(kvTokensDesc, prometheus.GaugeValue, float64(kv.Tokens), kv.Endpoint)
		ch <- prometheus.MustNewConstMetric(kvBytesDesc, prometheus.GaugeValue, float64(kv.Bytes), kv.Endpoint)
		ch <- prometheus.MustNewConstMetric(kvHandlesDesc, prometheus.GaugeValue, float64(kv.Handles), kv.Endpoint)
	}
}

// watchStore exports the number of retained handles when the store can
// count them (retention.Memory can; Redis cannot cheaply).
func (m *metrics) watchStore(s kvroute.Store) {
	l, ok := s.(interface{ Len() int })
	if !ok {
		return
	}
	m.reg.MustRegister(prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: "retained_handles",
		Help: "Decode handles retained in the store now."}, func() float64 { return float64(l.Len()) }))
}

// watchAdmission exports what the admission holds and refused.
func (m *metrics) watchAdmission(a *admission) {
	gauge := func(name, help string, get func(held) float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: name, Help: help},
			func() float64 { return get(a.held()) })
	}
	counter := func(name, help string, get func(held) float64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help},
			func() float64 { return get(a.held()) })
	}
	m.reg.MustRegister(
		gauge("buffered_request_bytes", "Bytes held by the requests being received or served, charged as they arrive: request bodies and the decode answers held whole (non-streaming answers, buffered streams); bounded by --max-buffered-bytes.",
			func(h held) float64 { return float64(h.bytes) }),
		gauge("buffered_answer_bytes", "Of buffered_request_bytes, the decode answers held whole (non-streaming answers, buffered streams) until they are written.",
			func(h held) float64 { return float64(h.answers) }),
		gauge("buffered_bytes_high_water", "The most bytes buffered_request_bytes held at once since the proxy started (at most --max-buffered-bytes).",
			func(h held) float64 { return float64(h.peak) }),
		gauge("client_connections", "Client connections open (bounded by --max-connections).",
			func(h held) float64 { return float64(h.conns) }),
		gauge("idle_client_connections", "Client connections waiting for a request: connected or idle between requests.",
			func(h held) float64 { return float64(h.waiting) }),
		gauge("request_bodies_in_transit", "Completion request bodies being received (bounded by --max-bodies-in-transit, and per client address by --max-client-bodies-in-transit).",
			func(h held) float64 { return float64(h.transit) }),
		counter("evicted_connections_total", "Connections closed at --max-connections to admit a new one: the one waiting longest for a request.",
			func(h held) float64 { return float64(h.evicted) }),
		counter("refused_connections_total", "Connections refused at --max-connections with 503 (no connection had waited long enough to be closed instead).",
			func(h held) float64 { return float64(h.refused) }),
		counter("slow_bodies_cut_total", "Request bodies in transit cut (answered 408) to give their slot to a new body at --max-bodies-in-transit or --max-client-bodies-in-transit: each the slowest below --min-body-rate.",
			func(h held) float64 { return float64(h.cut) }),
	)
}

func (m *metrics) hitRatio() float64 {
	m.lookedUp.mu.Lock()
	defer m.lookedUp.mu.Unlock()
	if m.lookedUp.hits+m.lookedUp.miss == 0 {
		return math.NaN()
	}
	return float64(m.lookedUp.hits) / float64(m.lookedUp.hits+m.lookedUp.miss)
}

// rejectedBeforeLookup reports whether a turn failed before it reached
// lookup: a request the router refused (a bad body, the router closed).
// Such a turn has ErrPhase lookup (the lookup itself never fails: store
// errors are misses), and Reuse "" or, from older routers, "miss" or "off".
func rejectedBeforeLookup(rec *kvroute.TurnRecord) bool {
	return rec.Err != nil && (rec.Reuse == "" || rec.ErrPhase == kvroute.PhaseLookup)
}

// rejectReason labels a turn rejected before lookup.
func rejectReason(err error) string {
	switch {
	case errors.Is(err, kvroute.ErrBadRequest):
		return "bad_request"
	case errors.Is(err, kvroute.ErrClosed):
		return "closed"
	}
	return "other"
}

// observe records one finished turn.
func (m *metrics) observe(rec *kvroute.TurnRecord) {
	if rejectedBeforeLookup(rec) {
		m.rejected.WithLabelValues(statusLabel(kvroute.HTTPStatus(rec.Err)), rejectReason(rec.Err)).Inc()
		return
	}
	m.fields.observe(rec)
	reuse := labelShape(string(rec.Reuse))
	if rec.Reuse == "" {
		reuse = "none"
	}
	result := "ok"
	if rec.Err != nil {
		result = "error"
		m.errors.WithLabelValues(labelShape(string(rec.ErrPhase))).Inc()
	}
	path := pathLabel(rec.Path)
	m.turns.WithLabelValues(path, reuse, result).Inc()
	switch rec.Reuse {
	case kvroute.ReuseHit:
		m.lookedUp.mu.Lock()
		m.lookedUp.hits++
		m.lookedUp.mu.Unlock()
		m.hits.Inc()
		m.handleAge.Observe(rec.HandleAge.Seconds())
		m.reusable.Observe(float64(rec.ReusableTokens))
	case kvroute.ReuseLocal:
		// A decode-local turn reused the decode engine's KV.
		m.lookedUp.mu.Lock()
		m.lookedUp.hits++
		m.lookedUp.mu.Unlock()
	case kvroute.ReuseMiss:
		m.lookedUp.mu.Lock()
		m.lookedUp.miss++
		m.lookedUp.mu.Unlock()
		m.misses.WithLabelValues(labelShape(string(rec.MissReason))).Inc()
	}
	if rec.Stored {
		m.stored.Inc()
	} else if rec.StoreRefusal != "" {
		m.refusals.WithLabelValues(refusalLabel(rec.StoreRefusal)).Inc()
	}
	if rec.LocalFallback {
		m.fallbacks.Inc()
	}
	if rec.Missing != "" {
		m.missing.WithLabelValues(labelShape(rec.Missing), path).Inc()
	}
	if rec.Buffered {
		m.buffered.WithLabelValues(path).Inc()
	}
	m.bytes.Add(float64(rec.Bytes))
	if rec.Prefill > 0 {
		m.prefill.WithLabelValues(reuse).Observe(rec.Prefill.Seconds())
	}
	if rec.FirstByte > 0 {
		m.firstByte.WithLabelValues(reuse).Observe(rec.FirstByte.Seconds())
	}
	if rec.Err == nil && rec.TTFT > 0 {
		m.ttft.WithLabelValues(reuse).Observe(rec.TTFT.Seconds())
		if rec.EstimatedTTFT > 0 {
			m.estimate.WithLabelValues(labelShape(string(rec.Choice))).Observe(float64(rec.TTFT) / float64(rec.EstimatedTTFT))
		}
	}
	m.duration.WithLabelValues(reuse).Observe(rec.Total.Seconds())
}

var (
	capabilityDesc = prometheus.NewDesc(namespace+"_engine_capability",
		"What the last capability probe found of an engine, per capability (kvroute/capability's names: render_chat, tokenize, handles_responses, stream_handles_messages, prefix_caching, ...): 1 present, 0 absent, -1 unknown. GET /ready has the reasons and fixes.",
		[]string{"role", "endpoint", "capability"}, nil)
	engineInfoDesc = prometheus.NewDesc(namespace+"_engine_info",
		"1 per probed engine, with its vLLM version and model (empty when unknown).", []string{"role", "endpoint", "version", "model"}, nil)
	engineBlockDesc = prometheus.NewDesc(namespace+"_engine_block_size",
		"The engine's KV block size in tokens (vllm:cache_config_info block_size); compare with --block-size.", []string{"role", "endpoint"}, nil)
	engineKVDesc = prometheus.NewDesc(namespace+"_engine_kv_capacity_tokens",
		"The engine's KV capacity in tokens per data-parallel rank (vllm:cache_config_info).", []string{"role", "endpoint"}, nil)
	engineImplausibleDesc = prometheus.NewDesc(namespace+"_engine_implausible_metrics",
		"Values of the engine's /metrics at the last capability probe that no real engine reports, ignored (GET /ready and bidikv-proxy doctor list them).", []string{"role", "endpoint"}, nil)
)

// capabilityCollector exports the engines' last capability reports at
// each scrape.
type capabilityCollector struct{ h *health }

// watchEngines exports the engines' capabilities.
func (m *metrics) watchEngines(h *health) { m.reg.MustRegister(capabilityCollector{h: h}) }

// Describe implements prometheus.Collector.
func (c capabilityCollector) Describe(ch chan<- *prometheus.Desc) {
	ch <- capabilityDesc
	ch <- engineInfoDesc
	ch <- engineBlockDesc
	ch <- engineKVDesc
	ch <- engineImplausibleDesc
}

// Collect implements prometheus.Collector.
func (c capabilityCollector) Collect(ch chan<- prometheus.Metric) {
	for _, e := range c.h.facts() {
		if e.rep == nil {
			continue
		}
		for _, n := range e.rep.Facts() {
			v := -1.0
			switch n.Fact.State {
			case capability.Present:
				v = 1
			case capability.Absent:
				v = 0
			}
			ch <- prometheus.MustNewConstMetric(capabilityDesc, prometheus.GaugeValue, v, e.role, e.url, n.Name)
		}
		ch <- prometheus.MustNewConstMetric(engineInfoDesc, prometheus.GaugeValue, 1, e.role, e.url, infoLabel(e.rep.VLLMVersion), infoLabel(e.rep.Model))
		ch <- prometheus.MustNewConstMetric(engineImplausibleDesc, prometheus.GaugeValue, float64(len(e.rep.Implausible)), e.role, e.url)
		if e.rep.BlockSize > 0 {
			ch <- prometheus.MustNewConstMetric(engineBlockDesc, prometheus.GaugeValue, float64(e.rep.BlockSize), e.role, e.url)
			ch <- prometheus.MustNewConstMetric(engineKVDesc, prometheus.GaugeValue, float64(e.rep.KVCacheTokens), e.role, e.url)
		}
	}
}

// setUp records an engine's health.
func (m *metrics) setUp(e *engine, up bool) {
	v := 0.0
	if up {
		v = 1
	}
	m.endpointUp.WithLabelValues(e.role, e.url).Set(v)
}

// handler serves the Prometheus text format.
func (m *metrics) handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{})
}

// labeledStat is one labelled series of a counter read from Router.Stats.
type labeledStat struct {
	value string
	get   func(kvroute.Stats) int64
}

// statsByLabel registers counter name with one series per stat, label
// set to its value, each read from r.Stats at scrape time.
func (m *metrics) statsByLabel(r *kvroute.Router, name, help, label string, stats []labeledStat) {
	for _, st := range stats {
		m.reg.MustRegister(prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help,
			ConstLabels: prometheus.Labels{label: st.value}},
			func() float64 { return float64(st.get(r.Stats())) }))
	}
}
