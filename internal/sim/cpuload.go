package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
)

// The engine's side of the CPU tier (cputier.go): the per-request keys in
// kv_transfer_params, write-through after each computed batch, the load
// after the GPU prefix-cache hit, and the peer tier (vLLM PR 48021:
// vllm/v1/kv_offload/tiering/p2p/manager.py, P2PSecondaryTierManager;
// p2p/session/*.py).

// offloadParams are the offloading connector's keys of a request:
// kv_transfer_params.remote_kv_source and kv_load_tiers, and the
// request's cache_salt (an extra key of its first block hash).
type offloadParams struct {
	source *kvSource
	tiers  tierFilter
	salt   string
}

// kvSource is remote_kv_source: the peer whose CPU tier to pull from.
type kvSource struct {
	id, host string
	port     int
}

// parseOffloadParams reads the offloading keys of req. A remote_kv_source
// without remote_host, remote_port or a non-empty kv_request_id is ignored
// (_parse_source): the request then uses only local tiers.
func parseOffloadParams(req *Request) *offloadParams {
	op := &offloadParams{}
	if raw, ok := req.Raw["cache_salt"]; ok {
		_ = json.Unmarshal(raw, &op.salt)
	}
	var m map[string]any
	if req.KVParams == nil || json.Unmarshal(req.KVParams, &m) != nil {
		return op
	}
	if src, ok := m["remote_kv_source"].(map[string]any); ok {
		id, _ := src["kv_request_id"].(string)
		host, _ := src["remote_host"].(string)
		port, _ := src["remote_port"].(float64)
		if id != "" && host != "" && port > 0 && port == float64(int(port)) {
			op.source = &kvSource{id: id, host: host, port: int(port)}
		}
	}
	raw, present := m["kv_load_tiers"]
	list, isList := raw.([]any)
	op.tiers = parseTierFilter(list, present, isList)
	return op
}

// p2pHello is what a peer session's ConnectMsg compares
// (P2PSession._on_connect): block_len (the chunk), the configuration
// fingerprint (model, block size, tensor-parallel layout) and the hash
// seed. Any mismatch rejects the peer: every lookup toward it misses.
type p2pHello struct {
	model       string
	blockSize   int
	chunkTokens int
	tp          int
	seed        uint64
}

// tierSource is a peer tier's server side as a puller reaches it through
// the registry.
type tierSource interface {
	hello(ctx context.Context) (p2pHello, error)
	// fetch answers each key HIT (with the chunk's KV, copied) or MISS
	// (ServerRole._process_inbound_lookup), by index in keys.
	fetch(ctx context.Context, keys []uint64) (map[int][]uint64, error)
}

// p2pEndpoint is rank k's peer-tier side channel. It speaks no NIXL: the
// Peer methods answer ErrUnreachable.
type p2pEndpoint struct {
	e *Engine
	k int
}

var errNotNIXL = fmt.Errorf("%w: a peer-tier port speaks no NIXL", ErrUnreachable)

func (p *p2pEndpoint) Meta(context.Context) (string, float64, error) { return "", 0, errNotNIXL }

func (p *p2pEndpoint) Read(context.Context, string, string, []int, int) ([][]uint64, error) {
	return nil, errNotNIXL
}

func (p *p2pEndpoint) Notify(context.Context, string, string) error { return errNotNIXL }

func (p *p2pEndpoint) Heartbeat(context.Context, string, string) error { return errNotNIXL }

func (p *p2pEndpoint) hello(context.Context) (p2pHello, error) {
	p.e.mu.Lock()
	defer p.e.mu.Unlock()
	if p.e.closed {
		return p2pHello{}, ErrUnreachable
	}
	return p.e.hello(p.k), nil
}

// fetch copies the chunks rank k's tier holds among keys. The source
// needs no request of its own; its LRU order is not touched.
func (p *p2pEndpoint) fetch(_ context.Context, keys []uint64) (map[int][]uint64, error) {
	p.e.mu.Lock()
	defer p.e.mu.Unlock()
	if p.e.closed {
		return nil, ErrUnreachable
	}
	tier := p.e.ranks[p.k].tier
	out := map[int][]uint64{}
	tier.servedLookups++
	for i, k := range keys {
		if ch, ok := tier.chunks[k]; ok {
			out[i] = append([]uint64(nil), ch.kv...)
			tier.servedChunks++
		}
	}
	return out, nil
}

// hello is rank k's handshake; e.mu held.
func (e *Engine) hello(k int) p2pHello {
	return p2pHello{model: e.cfg.Model, blockSize: e.cfg.BlockSize, chunkTokens: e.ranks[k].tier.chunkTokens(),
		tp: e.cfg.TPSize, seed: e.ranks[k].tier.seed}
}

// RankP2PAddr returns rank k's peer-tier address (the side-channel host,
// the P2P base port + k), what a remote_kv_source names; ok is false when
// the engine has no peer tier.
func (e *Engine) RankP2PAddr(k int) (host string, port int, ok bool) {
	if !e.cfg.CPUTier.enabled() || !e.cfg.CPUTier.P2P {
		return "", 0, false
	}
	return e.cfg.SideHost, e.cfg.CPUTier.p2pPort() + k, true
}

var errRejected = errors.New("sim: peer tier rejected the handshake")

// peerPrefetch asks the peer t's remote_kv_source names for the prompt's
// chunk keys (the lookup round trip and the fetch), before t queues: the
// chunks found are promoted at admission (tierLoad). A dead peer or a
// rejected handshake leaves nothing: every lookup misses and the request
// computes what its tiers lack. e.mu not held.
func (e *Engine) peerPrefetch(ctx context.Context, t *turn) {
	op := t.offload
	if op == nil || op.source == nil || !e.cfg.CPUTier.P2P || !op.tiers.allowsPeer() {
		return
	}
	e.mu.Lock()
	tier := e.ranks[t.rank].tier
	keys := tier.keys(t.toks, e.cfg.CPUTier.algo(), op.salt)
	mine := e.hello(t.rank)
	tier.peerPulls++
	e.mu.Unlock()
	t.peerAsked = true
	err := func() error {
		src, ok := e.reg.Lookup(op.source.host, op.source.port).(tierSource)
		if !ok {
			return ErrUnreachable
		}
		theirs, err := src.hello(ctx)
		if err != nil {
			return err
		}
		if theirs != mine {
			return errRejected
		}
		t.peerKV, err = src.fetch(ctx, keys)
		return err
	}()
	if err != nil {
		e.mu.Lock()
		if errors.Is(err, errRejected) {
			e.ranks[t.rank].tier.peerRejects++
		}
		e.mu.Unlock()
		e.log.Debug("peer tier lookup failed: every chunk misses", "peer", addrKey(op.source.host, op.source.port), "err", err)
	}
}

// tierLoad runs the offloading connector's lookup for t at admission,
// after its GPU prefix-cache hit of hit tokens: consecutive chunk hits
// from chunk hit/chunk on, each from the local CPU tier or else from the
// prefetched peer chunks (promoted into the local tier first; a chunk
// with no room there is a miss), ending at the first miss. With less
// than one chunk beyond the hit nothing loads. The loaded KV is written
// into t's blocks, which join the prefix cache; the chunks stay pinned
// until the load's time has passed (unpinTier). MultiConnector: when the
// NixlConnector reads (PullRead) it loads the request alone. e.mu held.
func (e *Engine) tierLoad(r *rank, t *turn, toks []uint32) {
	tier := r.tier
	if tier == nil || t.started {
		return
	}
	salt := ""
	if t.offload != nil {
		salt = t.offload.salt
	}
	keys := tier.keys(toks, e.cfg.CPUTier.algo(), salt)
	if _, plan := e.pullPlan(t); plan == PullRead {
		tier.touch(keys)
		return
	}
	ct := tier.chunkTokens()
	first := t.hit / ct
	var use []*cpuChunk
	promoted := 0
	for i := first; i < len(keys); i++ {
		ch, ok := tier.chunks[keys[i]]
		if !ok {
			kv, peer := t.peerKV[i]
			if !peer || len(kv) != ct {
				t.peerMissed = t.peerAsked
				break
			}
			if _, ok := tier.store(keys[i:i+1], [][]uint64{kv}, nil); !ok {
				break // no CPU slot for the promotion: a miss
			}
			ch, promoted = tier.chunks[keys[i]], promoted+1
		}
		ch.pins++ // read: not evictable by the promotions that follow
		use = append(use, ch)
	}
	if t.peerAsked && first+len(use) < len(keys) {
		tier.peerMisses++
	}
	tier.touch(keys)
	tokens := (first+len(use))*ct - t.hit
	if tokens < ct {
		for _, ch := range use {
			ch.pins--
		}
		return
	}
	for pos := t.hit; pos < t.hit+tokens; pos++ {
		ch := use[pos/ct-first]
		s := t.seq.at(pos)
		s.kv, s.tok = ch.kv[pos%ct], toks[pos]
	}
	t.pool.commit(t.seq.blocks, toks[:t.hit+tokens])
	t.tierPins, t.tierTokens, t.peerTokens = use, tokens, promoted*ct
	tier.loadedLocal += len(use)
	tier.loadedPeer += promoted
	tier.loadTokens += tokens
	tier.loadSeconds += e.cfg.Profile.HostToDevice(tokens).Seconds()
}

// unpinTier ends t's CPU→GPU load: its chunks become evictable; e.mu held.
func (e *Engine) unpinTier(t *turn) {
	for _, ch := range t.tierPins {
		ch.pins--
	}
	t.tierPins = nil
}

// offload stores the whole chunks of toks[:upto] that t has not stored
// yet (write-through after a computed batch), prompt chunks only unless
// CPUTier.OffloadGenerated; the KV comes from t's blocks. A failed batch
// (no room) counts an allocation failure and is tried again at the next
// batch. e.mu held.
func (e *Engine) offload(t *turn, toks []uint32, upto int) {
	r := t.rk
	if r == nil || r.tier == nil || t.seq == nil || t.pool != r.pool {
		return
	}
	if !e.cfg.CPUTier.OffloadGenerated {
		upto = min(upto, len(t.toks))
	}
	tier := r.tier
	ct := tier.chunkTokens()
	n := min(upto, len(t.seq.blocks)*t.pool.bs) / ct
	if n <= t.storedChunks {
		return
	}
	salt := ""
	if t.offload != nil {
		salt = t.offload.salt
	}
	keys := tier.keys(toks[:n*ct], e.cfg.CPUTier.algo(), salt)
	data := make([][]uint64, 0, n-t.storedChunks)
	for i := t.storedChunks; i < n; i++ {
		kv := make([]uint64, ct)
		for j := range kv {
			kv[j] = t.seq.at(i*ct + j).kv
		}
		data = append(data, kv)
	}
	written, ok := tier.store(keys[t.storedChunks:], data, keys)
	if !ok {
		tier.failures++
		e.log.Debug("cannot store chunks", "request", t.rec.EngineRequestID)
		return
	}
	tier.stored += written / ct
	tier.storeTokens += written
	tier.storeSeconds += e.cfg.Profile.HostToDevice(written).Seconds()
	t.storedChunks = n
}

// registerP2P binds every rank's peer-tier port (CPUTier.P2P).
func (e *Engine) registerP2P() error {
	if !e.cfg.CPUTier.enabled() || !e.cfg.CPUTier.P2P {
		return nil
	}
	base := e.cfg.CPUTier.p2pPort()
	for k := range e.cfg.dp() {
		p := &p2pEndpoint{e: e, k: k}
		if err := e.reg.Register(e.cfg.SideHost, base+k, p); err != nil {
			for j, q := range e.p2p {
				e.reg.Unregister(e.cfg.SideHost, base+j, q)
			}
			e.p2p = nil
			return err
		}
		e.p2p = append(e.p2p, p)
	}
	return nil
}

// tierMetrics are one rank's offloading metrics (offloading/metrics.py,
// cpu/common.py CPUOffloadingMetrics).
type tierMetrics struct {
	storeBytes, loadBytes, storeTime, loadTime, failures, pinned float64
}

// tierMetrics reads rank r's tier; e.mu held. Bytes are tokens times
// Profile.KVBytesPerToken (0 with a profile that has none).
func (e *Engine) tierMetrics(r *rank) tierMetrics {
	c := r.tier
	if c == nil {
		return tierMetrics{}
	}
	b := float64(e.cfg.Profile.KVBytesPerToken)
	return tierMetrics{storeBytes: float64(c.storeTokens) * b, loadBytes: float64(c.loadTokens) * b,
		storeTime: c.storeSeconds, loadTime: c.loadSeconds, failures: float64(c.failures),
		pinned: float64(c.pinned()) / float64(c.capacity)}
}

// tierSeries are the vllm:kv_offload_* series an engine with a CPU tier
// exports: the byte and time counters per direction, the allocation
// failures, and the usage gauges, which are chunks pinned by transfers in
// flight over capacity, not residency (get_stats: allocated − free −
// evictable; stores complete at once here, so _write_usage_perc is 0).
// vLLM exports no capacity series (PR 53902 is open), nor does this. The
// lookup-delay and size histograms are not modelled.
var tierSeries = []struct {
	name, typ, help string
	value           func(tierMetrics) float64
}{
	{"vllm:kv_offload_store_bytes_total", "counter", "Bytes stored from GPU to the offloading tier.",
		func(m tierMetrics) float64 { return m.storeBytes }},
	{"vllm:kv_offload_load_bytes_total", "counter", "Bytes loaded from the offloading tier to GPU.",
		func(m tierMetrics) float64 { return m.loadBytes }},
	{"vllm:kv_offload_store_time_total", "counter", "Seconds spent storing to the offloading tier.",
		func(m tierMetrics) float64 { return m.storeTime }},
	{"vllm:kv_offload_load_time_total", "counter", "Seconds spent loading from the offloading tier.",
		func(m tierMetrics) float64 { return m.loadTime }},
	{"vllm:kv_offload_allocation_failure_total", "counter", "Store batches skipped: no offloading space could be freed.",
		func(m tierMetrics) float64 { return m.failures }},
	{"vllm:kv_offload_cpu_cache_usage_perc", "gauge", "CPU offloading blocks in use by transfers, over capacity.",
		func(m tierMetrics) float64 { return m.pinned }},
	{"vllm:kv_offload_cpu_cache_write_usage_perc", "gauge", "CPU offloading blocks being written, over capacity.",
		func(tierMetrics) float64 { return 0 }},
	{"vllm:kv_offload_cpu_cache_read_usage_perc", "gauge", "CPU offloading blocks being read, over capacity.",
		func(m tierMetrics) float64 { return m.pinned }},
}
