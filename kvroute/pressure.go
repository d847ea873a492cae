package kvroute

import (
	"bufio"
	"bytes"
	"context"
	"io"
	"math"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/plausible"
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
// engine's process_start_time_seconds (restart.go).

// pressure is what the router last read of a decode engine's metrics.
type pressure struct {
	mu          sync.Mutex
	at          time.Time // when it was read (router clock); zero: never
	tried       time.Time // when a read last began: a failed one waits the interval too
	capacity    int64     // KV tokens; 0 unknown
	blockSize   int
	usage       float64 // 0 to 1; -1 unknown
	waiting     int
	preemptions float64 // the counter
	preempted   bool    // the counter grew since the reading before
	held        int64   // the ledger's held tokens on the engine when read
	reading     atomic.Bool
	live        atomic.Int64 // tokens of the decode legs in flight (memory.go, arrive)
	// maxModelLen is the engine's max_model_len (its GET /v1/models; 0
	// unknown), read when its process started at lenStart (room.go).
	maxModelLen int64
	lenStart    time.Time
}

// engineMetrics is one reading of an engine's /metrics.
type engineMetrics struct {
	start     time.Time // process_start_time_seconds; zero when absent
	capacity  int64
	blockSize int
	// size is the block size the engine's handles follow (shape.go):
	// effective_attention_block_size, else block_size; 0 when unknown.
	size                 int
	usage                float64
	usages               int // usage samples summed
	waiting              int
	preemptions          float64
	cacheInfo, pressures bool
	// The values ignored as implausible (internal/plausible), each as
	// plausible.Reading writes it; a figure with one is left out whole
	// (badUsage, badWaiting: the reading keeps the last good value).
	absurd                            []string
	badUsage, badWaiting, badCapacity bool
}

// press fills c with e's pressure, and has e's metrics read again when
// its reading is stale.
func (m *decodeMemory) press(e *endpoint, c *Candidate) {
	if !m.cfg.on {
		return
	}
	now := m.clock()
	p := &e.mem
	p.mu.Lock()
	at, usage, waiting, preempted, capacity, heldThen := p.at, p.usage, p.waiting, p.preempted, p.capacity, p.held
	last := at
	if p.tried.After(last) {
		last = p.tried
	}
	p.mu.Unlock()
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
	if m.cfg.interval < 0 || !e.mem.reading.CompareAndSwap(false, true) {
		return
	}
	e.mem.mu.Lock()
	e.mem.tried = now
	e.mem.mu.Unlock()
	if !m.bg.run(func(ctx context.Context) {
		defer e.mem.reading.Store(false)
		m.read(ctx, e)
	}) {
		e.mem.reading.Store(false)
	}
}

// read reads e's /metrics once and records what it tells.
func (m *decodeMemory) read(ctx context.Context, e *endpoint) {
	now := m.clock()
	// The ledger's holds before the engine is asked: those retained
	// while it answers are counted on top of its usage (press), perhaps
	// twice, never missed.
	held, _ := m.ledger.Held(e.url, now)
	em, err := m.fetch(ctx, e)
	if err != nil {
		return // the reading stays as it was; the next turn tries again
	}
	if len(em.absurd) > 0 {
		m.restarts.implausible(e.url, em.absurd)
	}
	readModelLen(ctx, m, e, em.start)
	p := &e.mem
	p.mu.Lock()
	if p.at.IsZero() {
		p.usage = -1 // unknown until a good reading
	}
	p.at, p.held = now, held
	if !em.badUsage {
		p.usage = -1
		if em.usages > 0 {
			p.usage = em.usage / float64(em.usages)
		}
	}
	if !em.badWaiting {
		p.waiting = em.waiting
	}
	p.preempted = em.pressures && p.preemptions > 0 && em.preemptions > p.preemptions
	if em.pressures {
		p.preemptions = em.preemptions
	}
	if em.cacheInfo {
		p.capacity, p.blockSize = em.capacity, em.blockSize
		if em.size > 0 {
			p.blockSize = em.size // the size its handles' blocks follow
		}
	}
	capacity, bs := p.capacity, p.blockSize
	p.mu.Unlock()
	if capacity > 0 {
		m.ledger.SetCapacity(e.url, budget.Capacity{Tokens: capacity, BlockSize: bs})
	}
	if !em.start.IsZero() {
		m.restarts.saw(e, now, em.start)
	}
	if m.shapes != nil {
		m.shapes.saw(e, em)
	}
}

// fetch GETs e's /metrics and parses it for e's rank.
func (m *decodeMemory) fetch(ctx context.Context, e *endpoint) (engineMetrics, error) {
	return fetchMetrics(ctx, m.client, e, m.clock)
}

// fetchMetrics GETs e's /metrics, within restartCheckTimeout, and parses
// it for e's rank at clock's time.
func fetchMetrics(ctx context.Context, client *upstream.Client, e *endpoint, clock func() time.Time) (engineMetrics, error) {
	var m engineMetrics
	_, err := client.Call(ctx, e.ep, metricsCall, func(r io.Reader) error {
		m = parseMetrics(r, e.ep.Rank, clock())
		return nil
	})
	return m, err
}

// parseMetrics reads Prometheus' text format for the metrics above, of
// the samples whose engine label is rank (all of them for a negative
// rank, or when none has the label), at now. Lines it cannot read are
// skipped; a value plausible.Check refuses leaves its figure out of the
// reading (noted in absurd), so that the last good one stays.
func parseMetrics(r io.Reader, rank int, now time.Time) engineMetrics {
	var m engineMetrics
	want := []byte(strconv.Itoa(rank))
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	legacy := engineMetrics{}
	for sc.Scan() {
		line := sc.Bytes()
		if v, ok := bytes.CutPrefix(line, []byte("process_start_time_seconds ")); ok {
			raw := string(bytes.TrimSpace(v))
			if f, err := strconv.ParseFloat(raw, 64); err == nil && m.plausible(plausible.Start, raw, f, now) {
				sec, frac := math.Modf(f)
				m.start = time.Unix(int64(sec), int64(frac*1e9))
			}
			continue
		}
		name, labels, value, ok := metricLine(line)
		if !ok {
			continue
		}
		if eng, has := label(labels, "engine"); rank >= 0 && has && !bytes.Equal(eng, want) {
			continue
		}
		raw := strconv.FormatFloat(value, 'g', -1, 64)
		switch string(name) {
		case "vllm:kv_cache_usage_perc":
			m.badUsage = !m.plausible(plausible.Usage, raw, value, now) || m.badUsage
			m.usage += value
			m.usages++
		case "vllm:gpu_cache_usage_perc":
			legacy.badUsage = !m.plausible(plausible.Usage, raw, value, now) || legacy.badUsage
			legacy.usage += value
			legacy.usages++
		case "vllm:num_requests_waiting":
			m.badWaiting = !m.plausible(plausible.Waiting, raw, value, now) || m.badWaiting
			m.waiting += int(min(max(value, 0), plausible.MaxWaiting))
		case "vllm:num_preemptions_total":
			if m.plausible(plausible.Preemptions, raw, value, now) {
				m.preemptions += value
				m.pressures = true
			}
		case "vllm:cache_config_info":
			m.cacheSample(labels, now)
		}
	}
	if m.usages == 0 {
		m.usage, m.usages, m.badUsage = legacy.usage, legacy.usages, legacy.badUsage
	}
	if m.badCapacity {
		// The cache configuration is left out whole, its block size too.
		m.capacity, m.blockSize, m.cacheInfo, m.size = 0, 0, false, 0
	}
	return m
}

// cacheSample adds a vllm:cache_config_info sample's capacity: its
// kv_cache_size_tokens, else num_gpu_blocks less the null block ×
// block_size. An implausible value makes the whole capacity of the
// reading unknown (badCapacity): a sum without one rank would be too small.
// It also reads the block size the engine's handles follow (size):
// effective_attention_block_size, the full-attention groups' block size
// (set by vLLM's EngineCore after the KV cache is made; None when the
// groups differ or before), else block_size (CacheConfig.metrics_info).
func (m *engineMetrics) cacheSample(labels []byte, now time.Time) {
	for _, key := range [...]string{"effective_attention_block_size", "block_size"} {
		raw := string(labelOr(labels, key))
		v, err := strconv.ParseInt(raw, 10, 64)
		if err != nil {
			continue // absent, or None
		}
		if plausible.Check(plausible.BlockSize, float64(v), now) == "" {
			m.size = int(v)
			break
		}
	}
	num := func(key string, metric plausible.Metric) (int64, bool) {
		raw := string(labelOr(labels, key))
		if raw == "" {
			return 0, false
		}
		v, err := strconv.ParseInt(raw, 10, 64)
		if err != nil {
			v = math.MaxInt64 // out of range (or not a number): implausible
		}
		if !m.plausible(metric, raw, float64(v), now) {
			m.badCapacity = true
			return 0, false
		}
		return v, true
	}
	bs, okBS := num("block_size", plausible.BlockSize)
	tokens, okT := num("kv_cache_size_tokens", plausible.KVTokens)
	blocks, okB := num("num_gpu_blocks", plausible.GPUBlocks)
	switch {
	case m.badCapacity || !okBS:
		return
	case !okT && okB:
		tokens, okT = (blocks-1)*bs, true // at most 2^31 × 2^16: no overflow
	}
	if !okT {
		return
	}
	if tokens < bs {
		m.absurd = append(m.absurd, plausible.Reading(plausible.KVTokens, strconv.FormatInt(tokens, 10), "below one block of "+strconv.FormatInt(bs, 10)))
		m.badCapacity = true
		return
	}
	m.capacity += tokens
	m.blockSize = int(bs)
	m.cacheInfo = true
}

// plausible reports whether v, written raw, is a plausible value of
// metric, and notes it in absurd when it is not.
func (m *engineMetrics) plausible(metric plausible.Metric, raw string, v float64, now time.Time) bool {
	if why := plausible.Check(metric, v, now); why != "" {
		m.absurd = append(m.absurd, plausible.Reading(metric, raw, why))
		return false
	}
	return true
}

// metricLine splits a sample line `name{labels} value` (labels may be
// absent); ok is false for a comment or a line it cannot read.
func metricLine(line []byte) (name, labels []byte, value float64, ok bool) {
	if len(line) == 0 || line[0] == '#' {
		return nil, nil, 0, false
	}
	end := bytes.LastIndexByte(line, ' ')
	if end <= 0 {
		return nil, nil, 0, false
	}
	v, err := strconv.ParseFloat(string(line[end+1:]), 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return nil, nil, 0, false
	}
	head := line[:end]
	if i := bytes.IndexByte(head, '{'); i >= 0 {
		if head[len(head)-1] != '}' {
			return nil, nil, 0, false
		}
		return head[:i], head[i+1 : len(head)-1], v, true
	}
	return head, nil, v, true
}

// label returns the value of label key in a label set `a="x",b="y"`, as
// written (escapes left in: the labels read here are numbers).
func label(labels []byte, key string) ([]byte, bool) {
	for len(labels) > 0 {
		eq := bytes.IndexByte(labels, '=')
		if eq < 0 || eq+1 >= len(labels) || labels[eq+1] != '"' {
			return nil, false
		}
		name := bytes.TrimSpace(bytes.TrimLeft(labels[:eq], ", "))
		rest := labels[eq+2:]
		q := 0
		for q < len(rest) && rest[q] != '"' {
			if rest[q] == '\\' {
				q++
			}
			q++
		}
		if q >= len(rest) {
			return nil, false
		}
		if string(name) == key {
			return rest[:q], true
		}
		labels = rest[q+1:]
	}
	return nil, false
}

func labelOr(labels []byte, key string) []byte {
	v, _ := label(labels, key)
	return v
}
