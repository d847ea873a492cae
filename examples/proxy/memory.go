package main

import (
	"flag"
	"fmt"
	"math"
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/retention/budget"
	"github.com/bidikv/bidikv/retention/redisstore"
	"github.com/bidikv/bidikv/transport"
)

// memoryConfig is decode memory as a managed budget (kvroute's
// DecodeMemory; README, "Decode memory"): the flags, and the ledger the
// router keeps its holds and learned pauses in, which /metrics reads.
type memoryConfig struct {
	budget    float64
	headroom  float64
	roomRate  float64
	capacity  int64
	watermark float64
	interval  time.Duration
	releases  int
	journal   bool // --decode-memory-journal
	tier      cpuTier

	ledger *budget.Budget // made by decodeMemory
	// shared is the Redis journal the ledger shares with the other
	// proxies of --redis-url (newStack sets it; nil: none).
	shared budget.Journal
}

// flags adds the decode memory flags to fs.
func (m *memoryConfig) flags(fs *flag.FlagSet) {
	d := kvroute.Defaults().DecodeMemory
	fs.Float64Var(&m.budget, "decode-memory-budget", d.Budget, "share of each decode engine's KV capacity this proxy's retained handles may hold: above it, the holds least likely to be used (by the learned pauses between turns) are released with a one-token request to a prefill engine; under it, only to make room for a decode leg that arrives at an engine they fill. Handles a turn replaces are released through its own prefill leg. A negative value turns this off: every handle held for --retention-ttl, as the reference proxy")
	fs.Float64Var(&m.headroom, "decode-memory-headroom", d.Headroom, "share of each decode engine's KV capacity kept free of holds when a decode leg arrives: while the engine's holds and the decode legs in flight (each counted as its prompt and max_tokens) take more than the rest, the holds worth least are released so that the engine admits the leg at once (below 1; negative: no room made on arrival, holds released only above --decode-memory-budget)")
	fs.Float64Var(&m.roomRate, "decode-memory-room-rate", d.RoomRate, "share of a decode engine's KV capacity that one client's requests (one API key) may have released of other tenants' holds a minute to make room on arrival (at most a minute's worth at once; its own tenant's holds are released for it without limit); negative: no limit")
	fs.Int64Var(&m.capacity, "decode-kv-capacity", 0, "KV capacity in tokens of a decode engine whose /metrics do not report vllm:cache_config_info (0: read from /metrics)")
	fs.Float64Var(&m.watermark, "decode-high-watermark", d.HighWatermark, "KV usage (0 to 1, holds included) at or above which a decode engine takes no new conversation and its own conversations move while another engine has room (negative: never)")
	fs.DurationVar(&m.interval, "decode-metrics-interval", d.MetricsInterval, "how often each decode engine's /metrics (capacity, KV usage, waiting requests, preemptions) is read, in the background (0: never)")
	fs.IntVar(&m.releases, "decode-memory-releases", d.Releases, "release requests in flight at most")
	m.tier.flags(fs)
	fs.BoolVar(&m.journal, "decode-memory-journal", true, "with --redis-url and the decode memory managed, share the ledger of holds, engine capacities, decode legs in flight and learned pauses with the other proxies of the same Redis, through a stream beside the handles (synced every second), so that every proxy budgets against every proxy's holds; false: each proxy keeps its own and sees the others' only as unseen KV in the engines' /metrics")
}

// journalOf is the journal the ledger shares through store: the Redis
// store's with --decode-memory-journal and the management on, else none.
func (m *memoryConfig) journalOf(store kvroute.Store) budget.Journal {
	rs, ok := store.(*redisstore.Store)
	if !ok || !m.journal || m.budget < 0 {
		return nil
	}
	return rs.Journal(0)
}

// check validates the decode memory flags.
func (m *memoryConfig) check() error {
	switch {
	case math.IsNaN(m.budget) || m.budget > 1 || m.budget == 0:
		return fmt.Errorf("%w: --decode-memory-budget %v: use a share in (0, 1], or a negative value to hold every handle for --retention-ttl", errUsage, m.budget)
	case math.IsNaN(m.headroom) || m.headroom >= 1 || m.headroom == 0:
		return fmt.Errorf("%w: --decode-memory-headroom %v: use a share in (0, 1), or a negative value to make no room on arrival", errUsage, m.headroom)
	case math.IsNaN(m.roomRate) || m.roomRate == 0:
		return fmt.Errorf("%w: --decode-memory-room-rate %v: use a share of the capacity a minute, or a negative value for no limit", errUsage, m.roomRate)
	case math.IsNaN(m.watermark) || m.watermark > 1 || m.watermark == 0:
		return fmt.Errorf("%w: --decode-high-watermark %v: use a share in (0, 1], or a negative value for never", errUsage, m.watermark)
	case m.capacity < 0:
		return fmt.Errorf("%w: --decode-kv-capacity %d is negative", errUsage, m.capacity)
	case m.releases < 1:
		return fmt.Errorf("%w: --decode-memory-releases %d: at least 1", errUsage, m.releases)
	case m.tier.tokens > 0 && m.budget < 0:
		return fmt.Errorf("%w: --cpu-tier-tokens %d needs the decode memory management (its ledger records where each turn's KV is): --decode-memory-budget must not be negative", errUsage, m.tier.tokens)
	}
	return m.tier.check()
}

// defaultP2PPort is VLLM_P2P_SIDE_CHANNEL_PORT's default: the peer tier's
// base port, rank k listening on it + k.
const defaultP2PPort = 5710

// cpuTier is the decode engines' CPU tier (vLLM's OffloadingConnector
// with a p2p tier, docs/cpu-tier.md): the router serves from it
// (DecodeMemory's CPUTier fields) and the doctor checks it (--cpu-tier).
type cpuTier struct {
	tokens     int64 // per data-parallel rank; 0: no tier (unknown to the doctor)
	port       int
	peers      tierPeers
	promptOnly bool
	first      bool // --cpu-tier-first
}

// flags adds the CPU tier flags to fs (the "Decode memory" group).
func (t *cpuTier) flags(fs *flag.FlagSet) {
	fs.Int64Var(&t.tokens, "cpu-tier-tokens", 0, "the decode engines' CPU tier capacity in tokens per data-parallel rank (vLLM exports none): a turn whose decode hold is gone has its prefill engine pull the history from the tier of its conversation's last decode engine, when that is cheaper than recomputing (0: no tier)")
	fs.IntVar(&t.port, "cpu-tier-port", defaultP2PPort, "the peer tier's side-channel base port on the decode engines (VLLM_P2P_SIDE_CHANNEL_PORT; rank k: +k)")
	fs.Var(&t.peers, "cpu-tier-peers", "the peer tier's host:port of decode engines whose tier is not at --cpu-tier-port on their URL's host (VLLM_P2P_SIDE_CHANNEL_HOST and _PORT), comma-separated DECODE_URL=HOST:PORT")
	fs.BoolVar(&t.promptOnly, "cpu-tier-prompt-only", false, "the decode engines keep offload_prompt_only true (vLLM's default): their tiers hold each turn's prompt, not its answer")
	fs.BoolVar(&t.first, "cpu-tier-first", false, "a turn whose decode hold the decode engine's CPU tier is estimated to hold whole pulls it from the tier (by block hash: no render call to verify it) and releases the hold")
}

// check validates the CPU tier flags.
func (t *cpuTier) check() error {
	switch {
	case t.tokens < 0:
		return fmt.Errorf("%w: --cpu-tier-tokens %d is negative", errUsage, t.tokens)
	case t.port < 1 || t.port > 65535:
		return fmt.Errorf("%w: --cpu-tier-port %d is not a port (1 to 65535)", errUsage, t.port)
	}
	return nil
}

// unknownPeers warns of --cpu-tier-peers entries for no engine of decode
// (the URLs of --decode, normalized): the router never asks them.
func (t *cpuTier) unknownPeers(decode []string) []string {
	var out []string
	for u := range t.peers.m {
		if !slices.Contains(decode, u) {
			out = append(out, fmt.Sprintf("--cpu-tier-peers names %s, which is no decode engine (--decode: %s): its entry is never used", u, strings.Join(decode, ", ")))
		}
	}
	slices.Sort(out)
	return out
}

// tierPeers is --cpu-tier-peers: decode engine URL (as the proxy
// normalizes --decode) -> "host:port".
type tierPeers struct{ m map[string]string }

// String lists the entries as the flag takes them.
func (p *tierPeers) String() string {
	if p == nil {
		return ""
	}
	var out []string
	for u, hp := range p.m {
		out = append(out, u+"="+hp)
	}
	slices.Sort(out)
	return strings.Join(out, ",")
}

// Set adds the comma-separated DECODE_URL=HOST:PORT entries of s.
func (p *tierPeers) Set(s string) error {
	for _, e := range strings.Split(s, ",") {
		e = strings.TrimSpace(e)
		if e == "" {
			continue
		}
		i := strings.LastIndexByte(e, '=')
		if i < 0 {
			return fmt.Errorf("%q: want DECODE_URL=HOST:PORT", e)
		}
		ep, err := transport.ParseEndpoint(e[:i])
		if err != nil {
			return fmt.Errorf("%q: the decode URL: %v", e, err)
		}
		hp := e[i+1:]
		host, port, err := net.SplitHostPort(hp)
		n, perr := strconv.Atoi(port)
		if err != nil || host == "" || perr != nil || n < 1 || n > 65535 {
			return fmt.Errorf("%q: want DECODE_URL=HOST:PORT, the peer tier's host and port (1 to 65535) after =", e)
		}
		if p.m == nil {
			p.m = map[string]string{}
		}
		p.m[ep.URL.String()] = hp
	}
	return nil
}

// decodeMemory is the router's DecodeMemory for these flags, with the
// ledger /metrics reads (made once).
func (m *memoryConfig) decodeMemory(local bool, kvBytesPerToken int64, blockSize int) kvroute.DecodeMemory {
	dm := kvroute.DecodeMemory{Local: local, KVBytesPerToken: kvBytesPerToken, HighWatermark: m.watermark, Headroom: m.headroom,
		RoomRate: m.roomRate, MetricsInterval: none(m.interval), Releases: m.releases}
	if m.ledger == nil {
		opts := []budget.Option{budget.WithFraction(max(m.budget, 0)), budget.WithCapacity(m.capacity)}
		if m.budget < 0 {
			opts = opts[1:] // off: the ledger only counts
		}
		if blockSize > 0 {
			opts = append(opts, budget.WithBlockSize(blockSize))
		}
		l, err := budget.New(opts...)
		if err != nil {
			// check rules the values out; a ledger of the defaults
			// keeps the proxy's figures.
			l, _ = budget.New()
		}
		m.ledger = l
	}
	dm.Ledger = m.ledger
	dm.Journal = m.shared
	dm.CPUTierTokens, dm.CPUTierPort = int(m.tier.tokens), m.tier.port
	dm.CPUTierPeers, dm.CPUTierPromptOnly, dm.CPUTierFirst = m.tier.peers.m, m.tier.promptOnly, m.tier.first
	if m.budget < 0 {
		dm.Budget = -1
	}
	return dm
}

var (
	kvHeldBlocksDesc = prometheus.NewDesc(namespace+"_decode_kv_pinned_tokens",
		"KV each decode engine pins for this proxy's live retained handles, in whole blocks × block size: what counts against the budget.", []string{"endpoint"}, nil)
	kvCapacityDesc = prometheus.NewDesc(namespace+"_decode_kv_capacity_tokens",
		"Each decode engine's KV capacity in tokens (vllm:cache_config_info, or --decode-kv-capacity; 0: unknown).", []string{"endpoint"}, nil)
	kvBudgetDesc = prometheus.NewDesc(namespace+"_decode_kv_budget_tokens",
		"The share of each decode engine's capacity this proxy's holds may pin (--decode-memory-budget; 0: none, capacity unknown or management off).", []string{"endpoint"}, nil)
	kvAgesDesc = prometheus.NewDesc(namespace+"_decode_kv_held_handles_by_age",
		"Live retained handles per decode engine by age: at most le seconds old (le +Inf: all).", []string{"endpoint", "le"}, nil)
	kvUsageDesc = prometheus.NewDesc(namespace+"_decode_kv_usage",
		"Each decode engine's vllm:kv_cache_usage_perc (0 to 1, holds included) at the proxy's last reading (-1: not reported).", []string{"endpoint"}, nil)
	kvUnseenDesc = prometheus.NewDesc(namespace+"_decode_kv_unseen_tokens",
		"Each decode engine's KV in use, at the proxy's last reading of its /metrics, beyond this proxy's holds and live decode legs (vllm:kv_cache_usage_perc × capacity, less both): other routers' holds and requests, holds of streams without a handle, orphaned holds; counted as used by the decode memory management.", []string{"endpoint"}, nil)
	kvWaitingDesc = prometheus.NewDesc(namespace+"_decode_waiting_requests",
		"Each decode engine's vllm:num_requests_waiting at the proxy's last reading.", []string{"endpoint"}, nil)
	kvPreemptDesc = prometheus.NewDesc(namespace+"_decode_preemptions",
		"Each decode engine's vllm:num_preemptions_total at the proxy's last reading.", []string{"endpoint"}, nil)
	gapDesc = prometheus.NewDesc(namespace+"_turn_gap_seconds",
		"The learned pause before a conversation's next turn, among those that come back within the horizon (30 min), over every tenant and model.", []string{"quantile"}, nil)
	returnDesc = prometheus.NewDesc(namespace+"_turn_return_probability",
		"The learned chance that a conversation comes back within the horizon (30 min), over every tenant and model.", nil, nil)
	journalRecordsDesc = prometheus.NewDesc(namespace+"_decode_ledger_journal_records_total",
		"The decode-memory ledger's journal (--decode-memory-journal), by what happened to a record: appended (this proxy's changes sent), applied (the other proxies' changes read), dropped (changes not sent: the queue full while Redis failed), invalid (records read that could not be decoded), stale (late or repeated changes, applied as nothing).", []string{"outcome"}, nil)
	journalErrorsDesc = prometheus.NewDesc(namespace+"_decode_ledger_journal_errors_total",
		"Syncs of the decode-memory ledger's journal that failed (Redis unreachable or slow): the proxies' ledgers drift apart until it answers (logged once per outage).", nil, nil)
	journalSyncedDesc = prometheus.NewDesc(namespace+"_decode_ledger_journal_last_sync_timestamp_seconds",
		"When the ledger's journal last synced without error (Unix time; 0: never): more than a few seconds ago means the proxies' ledgers are drifting apart.", nil, nil)
	journalPeersDesc = prometheus.NewDesc(namespace+"_decode_ledger_journal_peers",
		"Other proxies whose decode legs in flight this proxy counts now (their last report within the lease).", nil, nil)
	withinDesc = prometheus.NewDesc(namespace+"_next_turn_probability",
		"The learned chance of a next turn within --retention-ttl, by the turn number group (first turn of the group) and whether the reply ended in tool calls.", []string{"turn", "tool_calls"}, nil)
)

// memoryCollector exports the decode memory's holds, pressure and learned
// pauses at each scrape.
type memoryCollector struct {
	r       *kvroute.Router
	ledger  *budget.Budget
	window  time.Duration
	clock   func() time.Time
	journal bool // the ledger syncs through a journal: export its figures
}

// Describe implements prometheus.Collector.
func (c memoryCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{kvHeldBlocksDesc, kvCapacityDesc, kvBudgetDesc, kvAgesDesc, kvUsageDesc,
		kvUnseenDesc, kvWaitingDesc, kvPreemptDesc, gapDesc, returnDesc, withinDesc,
		journalRecordsDesc, journalErrorsDesc, journalSyncedDesc, journalPeersDesc} {
		ch <- d
	}
}

// Collect implements prometheus.Collector.
func (c memoryCollector) Collect(ch chan<- prometheus.Metric) {
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	bounds := budget.AgeBounds()
	for _, kv := range c.r.DecodeKV() {
		gauge(kvHeldBlocksDesc, float64(kv.HeldTokens), kv.Endpoint)
		gauge(kvCapacityDesc, float64(kv.Capacity), kv.Endpoint)
		gauge(kvBudgetDesc, float64(kv.Budget), kv.Endpoint)
		n := 0
		for i, k := range kv.Ages {
			n += k
			le := "+Inf"
			if i < len(bounds) {
				le = strconv.FormatFloat(bounds[i].Seconds(), 'g', -1, 64)
			}
			gauge(kvAgesDesc, float64(n), kv.Endpoint, le)
		}
		if !kv.MetricsRead.IsZero() {
			gauge(kvUsageDesc, kv.KVUsage, kv.Endpoint)
			gauge(kvUnseenDesc, float64(kv.Unseen), kv.Endpoint)
			gauge(kvWaitingDesc, float64(kv.Waiting), kv.Endpoint)
			gauge(kvPreemptDesc, float64(kv.Preemptions), kv.Endpoint)
		}
	}
	if c.ledger == nil {
		return
	}
	if c.journal {
		c.collectJournal(ch)
	}
	snap := c.ledger.Snapshot(c.clock(), c.window)
	if len(snap.Classes) == 0 {
		return
	}
	all := snap.Classes[0]
	if all.Returns > 0 {
		gauge(gapDesc, all.P50.Seconds(), "0.5")
		gauge(gapDesc, all.P90.Seconds(), "0.9")
		gauge(gapDesc, all.P99.Seconds(), "0.99")
	}
	gauge(returnDesc, all.Return)
	for _, f := range all.Within {
		gauge(withinDesc, f.Probability, strconv.Itoa(f.FirstTurn), strconv.FormatBool(f.ToolCalls))
	}
}

// collectJournal exports the ledger's journal figures.
func (c memoryCollector) collectJournal(ch chan<- prometheus.Metric) {
	js := c.ledger.Stats().Journal
	for _, r := range []struct {
		outcome string
		n       int64
	}{{"appended", js.Appended}, {"applied", js.Applied}, {"dropped", js.Dropped}, {"invalid", js.Invalid}, {"stale", js.Stale}} {
		ch <- prometheus.MustNewConstMetric(journalRecordsDesc, prometheus.CounterValue, float64(r.n), r.outcome)
	}
	ch <- prometheus.MustNewConstMetric(journalErrorsDesc, prometheus.CounterValue, float64(js.Errors))
	synced := 0.0
	if !js.Synced.IsZero() {
		synced = float64(js.Synced.UnixNano()) / 1e9
	}
	ch <- prometheus.MustNewConstMetric(journalSyncedDesc, prometheus.GaugeValue, synced)
	ch <- prometheus.MustNewConstMetric(journalPeersDesc, prometheus.GaugeValue, float64(js.Sources))
}

// watchMemory exports the decode memory's releases, holds, pressure and
// learned pauses.
func (m *metrics) watchMemory(r *kvroute.Router, ledger *budget.Budget, window time.Duration, journal bool) {
	m.statsByLabel(r, "decode_releases_total", "Decode holds released before their TTL, by reason: superseded (a turn's prefill leg released the handle it replaced), unusable (a handle past --retention-ttl still held), budget (a release request for a hold over its engine's budget), room (one in the way of a decode leg arriving at its engine), expired (a hold whose --retention-ttl ended without a next turn, released then rather than at the engine's decoder_kv_blocks_ttl), and handles the proxy did not keep: n_gt_1 (an answer of n > 1 choices), refused (a turn not retained, or too large for the store), store_error (the store failed to keep it), overwritten (found under the key a turn retained its own handle under: two turns of one conversation at once), session_final (a turn whose request ended its session with X-Dynamo-Session-Final: true, or a conversation its client deleted: DELETE /v1/conversations/{id}).",
		"reason", []labeledStat{
			{"superseded", func(s kvroute.Stats) int64 { return s.ReleasedSuperseded }},
			{"unusable", func(s kvroute.Stats) int64 { return s.ReleasedUnusable }},
			{"budget", func(s kvroute.Stats) int64 { return s.ReleasedBudget }},
			{"room", func(s kvroute.Stats) int64 { return s.ReleasedRoom }},
			{"expired", func(s kvroute.Stats) int64 { return s.ReleasedExpired }},
			{"n_gt_1", func(s kvroute.Stats) int64 { return s.ReleasedNChoices }},
			{"refused", func(s kvroute.Stats) int64 { return s.ReleasedRefused }},
			{"store_error", func(s kvroute.Stats) int64 { return s.ReleasedStoreError }},
			{"overwritten", func(s kvroute.Stats) int64 { return s.ReleasedOverwritten }},
			{"session_final", func(s kvroute.Stats) int64 { return s.ReleasedFinal }},
		})
	m.statsByLabel(r, "decode_room_limited_total", "Decode legs that made less room on arrival than their engine's holds and live legs called for, by reason: rejected (the engine will reject the request: max_tokens over its max_model_len, alone or with the prompt), rate_limited (its client released --decode-memory-room-rate of other tenants' holds already).",
		"reason", []labeledStat{
			{"rejected", func(s kvroute.Stats) int64 { return s.RoomRejected }},
			{"rate_limited", func(s kvroute.Stats) int64 { return s.RoomLimited }},
		})
	stat := func(name, help string, get func(kvroute.Stats) int64) prometheus.Collector {
		return prometheus.NewCounterFunc(prometheus.CounterOpts{Namespace: namespace, Name: name, Help: help},
			func() float64 { return float64(get(r.Stats())) })
	}
	m.reg.MustRegister(
		stat("decode_release_failures_total", "Releases that failed (the hold lapses at the engines' TTL).",
			func(s kvroute.Stats) int64 { return s.ReleaseFailures }),
		stat("decode_release_skipped_total", "Holds not released because their decode engine restarted since (their blocks are gone).",
			func(s kvroute.Stats) int64 { return s.ReleaseSkipped }),
		stat("decode_release_gone_total", "Holds over the budget already taken from the store when their release came (a turn or another replica had them).",
			func(s kvroute.Stats) int64 { return s.ReleaseGone }),
		stat("decode_unreleasable_total", "Decode handles the proxy did not keep and could not release either (one vLLM would misread, of push mode, or whose store write failed while the store could not say it does not hold it): they lapse at the engines' TTL.",
			func(s kvroute.Stats) int64 { return s.Unreleasable }),
		stat("decode_prefix_unshared_total", "Holds whose blocks the ledger could not match with other holds' (token verification): the decode engine's block size, as its /metrics report it, was not the one the handle was fingerprinted with, so each block was counted as the hold's own.",
			func(s kvroute.Stats) int64 { return s.PrefixUnshared }),
		memoryCollector{r: r, ledger: ledger, window: window, clock: time.Now, journal: journal},
	)
}
