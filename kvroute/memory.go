package kvroute

import (
	"context"
	"fmt"
	"hash/maphash"
	"log/slog"
	"slices"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/decodemem"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/retention/budget"
	"github.com/bidikv/bidikv/threshold"
)

// Decode memory as a managed budget (WithDecodeMemory; docs/kvroute.md,
// Decode memory). A vLLM decode engine keeps every finished request's
// blocks for decoder_kv_blocks_ttl, pinned, whether or not a next turn
// comes. The Router keeps a ledger of the holds its retained handles pin
// on each engine (retention/budget; one ledger may serve every Router
// replica of a process: DecodeMemory.Ledger), learns from the pauses
// between turns which conversations come back, and:
//
//   - releases a handle a turn took and does not attach, when the turn
//     replaces it, through the turn's own prefill leg (lookup.go);
//   - when its holds on an engine go over the budget, releases those
//     worth least with release requests, in the background (releaser);
//   - makes room for a decode leg arriving at an engine its holds fill,
//     within what the request can use and its principal's rate (below; the rate: internal/decodemem);
//   - releases every decode handle it receives and does not keep
//     (releaser.go, orphans);
//   - shows the selector each engine's pressure (pressure.go).

// decodeMemory is the Router's management of what its retained handles
// hold on the decode engines: the ledger, the engines' capacity and
// pressure, and the release requests.
type decodeMemory struct {
	cfg    memoryConfig
	ledger *budget.Budget
	// saved estimates the prefill time a hit on a hold of tokens saves:
	// the cost model's, else one microsecond a token.
	saved func(tokens int) time.Duration
	clock func() time.Time
	ttl   time.Duration // the retention TTL: how long a hold can be attached
	// linger is how long the Store keeps an entry past ttl, for the
	// release of its hold when its retention ends (sweep, below).
	linger time.Duration
	client *upstream.Client
	meter  *meter // the one reader of /metrics (pressure.go)
	stats  *counters
	log    *logger
	bg     background
	rel    releaser
	limits decodemem.RoomLimits // DecodeMemory's RoomRate, by principal
	seed   maphash.Seed         // of the holds' prefix scopes (prefixOf)
}

// newDecodeMemory makes the Router's decode memory management (off:
// the ledger only counts).
func newDecodeMemory(r *Router) (*decodeMemory, error) {
	c := &r.cfg
	m := &decodeMemory{cfg: c.memory, ledger: c.memory.ledger, clock: c.clock, ttl: c.retentionTTL,
		client: r.client.Client, meter: &r.meter, stats: &r.stats, log: &r.log,
		limits: decodemem.RoomLimits{Rate: c.memory.roomRate}, seed: maphash.MakeSeed()}
	// The ledger counts a hold until the engine's own TTL unless it is
	// released (sweep, below).
	opts := []budget.Option{budget.WithFraction(c.memory.fraction), budget.WithCapacity(c.memory.capacity),
		budget.WithGrace(max(c.decoderTTL-c.retentionTTL, 0))}
	if c.memory.on {
		m.linger = expiryGuard
	}
	if c.blockSize > 0 {
		opts = append(opts, budget.WithBlockSize(c.blockSize))
	}
	if c.memory.journal != nil {
		opts = append(opts, budget.WithJournal(c.memory.journal, ""))
	}
	if m.ledger != nil {
		// A given ledger keeps what its maker set, and takes the
		// router's settings for the rest (DecodeMemory.Ledger); a ledger
		// shared by several Routers takes them from the first, and a
		// later one's that differ are an error naming both.
		if err := m.ledger.Inherit(opts...); err != nil {
			return nil, fmt.Errorf("Ledger: %v (a Ledger shared by several Routers takes the first one's settings and a later one's "+
				"must agree: Budget is budget.WithFraction, Capacity WithCapacity, TTLs' DecoderBlocks - Retention WithGrace, WithBlockSize WithBlockSize)", err)
		}
	} else {
		l, err := budget.New(opts...)
		if err != nil {
			return nil, err
		}
		m.ledger = l
	}
	m.ledger.SetCPUTier(c.memory.tier.Tokens) // a hold the tier holds goes first: demoted, not dropped
	m.saved = savedBy(r.chooser, r.policy)
	m.bg.ctx, m.bg.cancel = context.WithCancel(context.Background())
	m.rel = releaser{mem: m, store: r.handles.store, prefill: r.prefill, decode: r.decode, bufs: &r.bufs.bytes,
		timeout: c.prefillTimeout, sem: make(chan struct{}, max(c.memory.releases, 1)),
		running: map[string]bool{}, again: map[string]bool{}}
	return m, nil
}

// estimator is a cost model that estimates each path of a turn
// (threshold.CostModel).
type estimator interface {
	Estimate(in threshold.Turn) (pull, local, recompute time.Duration)
}

// savedBy returns the saving of a hit of tokens: what the cost model
// estimates recomputing them costs more than pulling them, else one
// microsecond a token (value by tokens).
func savedBy(policies ...any) func(tokens int) time.Duration {
	for _, p := range policies {
		if e, ok := p.(estimator); ok {
			return func(tokens int) time.Duration {
				pull, _, recompute := e.Estimate(threshold.Turn{PromptTokens: tokens + 1, ReusableTokens: tokens})
				return max(recompute-pull, 0)
			}
		}
	}
	return func(tokens int) time.Duration { return time.Duration(tokens) * time.Microsecond }
}

// managed reports whether the management applies to the decode engine:
// it is on and the engine's capacity is known.
func (m *decodeMemory) managed(engine string) bool {
	if !m.cfg.on {
		return false
	}
	_, b := m.ledger.Held(engine, m.clock())
	return b > 0
}

// hold is what the ledger records of a retained entry: its class
// (tenant and model), turn and tool calls predict its conversation's
// next turn; it is held from created until the entry's retention ends,
// for the tenant (its Owner: makeRoom, below).
func (m *decodeMemory) hold(key, tenant string, e *entry.Entry, created time.Time) budget.Hold {
	h := budget.Hold{Key: key, Engine: e.Endpoint, Tokens: e.Tokens, Created: created, Expires: e.Created.Add(m.ttl),
		Features: budget.Features{Class: tenant + "\x00" + e.Model, Turn: e.Turn, ToolCalls: e.ToolCalls},
		Saved:    m.saved(e.Tokens), Owner: tenant}
	h.PrefixBlockSize, h.Prefix = prefixOf(m.seed, tenant, e)
	return h
}

// prefixOf names the full blocks D holds for e, as its prefix cache does,
// when token verification fingerprinted them (e.FP; nil in content
// verification, which knows no tokens: each hold's blocks are counted as
// its own). D's block hash is its tokens chained over every token before
// it, plus the request's LoRA and cache_salt (hash_block_tokens and
// generate_block_hash_extra_keys in vllm/v1/core/kv_cache_utils.py); the fingerprint's block hashes
// are the chain, and the tenant (which includes cache_salt) and model
// are mixed in, so holds share blocks only within one tenant and model:
// tenants that send one prompt unsalted share D's blocks but are counted
// apart (an overcount). The blocks read e.FP, during Add only.
func prefixOf(seed maphash.Seed, tenant string, e *entry.Entry) (int, budget.Blocks) {
	if len(e.FP) == 0 {
		return 0, nil
	}
	var ns maphash.Hash
	ns.SetSeed(seed)
	ns.WriteString(tenant)
	ns.WriteByte(0)
	ns.WriteString(e.Model)
	bs, blocks, ok := e.FP.Blocks(ns.Sum64())
	if !ok {
		return 0, nil
	}
	return bs, blocks
}

// added records a hold that a turn retained (or put back); over the
// engine's budget, it has the releaser release the holds worth least.
func (m *decodeMemory) added(h budget.Hold, grew bool) {
	if h.Tokens <= 0 || h.Engine == "" || !h.Expires.After(h.Created) {
		return // nothing the ledger can count (a handle of 0 tokens)
	}
	if h.Prefix != nil && h.PrefixBlockSize != m.ledger.BlockSize(h.Engine) {
		// The ledger counts each block as the hold's own.
		m.stats.prefixUnshared.Add(1)
		m.log.once(context.Background(), "prefix_block_size:"+h.Engine,
			"kvroute: a decode engine's block size is not the one its handles were fingerprinted with; its holds' shared prefixes are counted once per hold",
			slog.String("endpoint", h.Engine), slog.Int("fingerprint_block_size", h.PrefixBlockSize))
	}
	ep := m.rel.decode.find(h.Engine)
	if add := func() { _ = m.ledger.Add(h) }; grew && ep != nil {
		ep.mem.Retained(add) // the hold of a leg that ended: readings no longer count the leg (depart)
	} else {
		add()
	}
	if !grew || !m.cfg.on {
		return
	}
	var unseen int64
	if ep != nil {
		unseen = ep.mem.Snapshot().Unseen
	}
	nudgeOver(m, h.Engine, unseen)
}

// Making room on arrival. The budget caps what holds may take; under it
// they also yield to live work. Each decode leg counts its live tokens on
// its engine while it runs (liveTokens, below: its prompt and what it may
// generate, within the engine's max_model_len), in the ledger
// (budget.Budget.Running: every Router sharing the ledger sees them), and
// when the engine's holds and live legs pass its capacity less
// DecodeMemory's Headroom, the releaser releases the holds worth least
// until the live legs fit (room; other tenants' within the principal's
// RoomRate), in the background: the leg is sent at once, and the engine
// admits it as soon as the blocks are freed.

// defaultGeneration is the tokens a decode leg is counted to generate
// when its request names no limit (max_tokens and its kin).
const defaultGeneration = 1024

// bytesPerToken estimates a prompt's tokens from its request body when
// neither P's answer nor the turn's verification counted them.
const bytesPerToken = 4

// arrive counts t's decode leg live on ep (prompt: its prompt's tokens as
// P's answer or the turn's verification counted them, 0 when neither did)
// until its answer is whole (the
// retain then counts what D holds of it as a hold) or its Response is
// released (Response.leave), as what it can take there (liveTokens,
// below), and has room made on the engine when its holds and live
// legs no longer fit, once a turn (makeRoom, below). A leg the engine
// will reject counts nothing and makes no room (Stats.RoomRejected). It
// returns the tokens counted.
func (m *decodeMemory) arrive(t *turn, ep *endpoint, prompt int) int64 {
	if !m.cfg.on {
		return 0
	}
	c := m.ledger.Capacity(ep.url)
	maxLen := ep.mem.Snapshot().MaxModelLen
	tokens, admit := liveTokens(t, prompt, maxLen, c)
	if !admit {
		m.stats.roomRejected.Add(1)
		return 0
	}
	if tokens <= 0 {
		return 0
	}
	ep.mem.Live.Add(tokens)
	live := m.ledger.Running(ep.url, tokens) // every Router's sharing the ledger
	if m.cfg.headroom < 0 || t.roomMade || c <= 0 {
		return tokens
	}
	now := m.clock()
	if held, budget := m.ledger.Held(ep.url, now); held+live+ep.mem.Snapshot().Unseen > m.limit(c, budget) {
		// The victims are chosen now (a walk of the engine's holds,
		// no I/O), their release requests sent in the background.
		t.roomMade = true
		m.rel.start(makeRoom(m, t, ep, c, now), releaseRoom)
	}
	return tokens
}

// limit is what holds and live legs may take of an engine of capacity
// tokens whose holds may take budget (0: no budget): capacity less the
// headroom, and at most the budget, so that the engine's own usage, live
// work included, stays within the budget.
func (m *decodeMemory) limit(capacity, budget int64) int64 {
	l := int64(float64(capacity) * (1 - max(m.cfg.headroom, 0)))
	if budget > 0 {
		l = min(l, budget)
	}
	return l
}

// room is the incoming tokens the ledger's Victims is asked to make room
// for on ep: Victims frees held + incoming − budget; the budget wants
// held + unseen − budget freed (unseen KV counts as used: pressure.go),
// and room held + live + unseen − limit, so incoming is the larger of
// unseen and live + unseen − limit + budget (0: the budget alone rules).
func (m *decodeMemory) room(ep *endpoint) int {
	if ep == nil {
		return 0
	}
	c := m.ledger.Capacity(ep.url)
	if c <= 0 {
		return 0
	}
	unseen := ep.mem.Snapshot().Unseen
	if m.cfg.headroom < 0 {
		return int(unseen)
	}
	_, budget := m.ledger.Held(ep.url, m.clock())
	return int(max(m.ledger.Running(ep.url, 0)+unseen-m.limit(c, budget)+budget, unseen, 0))
}

// depart ends the count of a decode leg's tokens live on ep (arrive's).
// Until its retain adds its hold (added), ep's readings count it as the
// router's own, not as unseen KV (pressure.go).
func (m *decodeMemory) depart(ep *endpoint, tokens int64) {
	if tokens != 0 {
		ep.mem.Live.Add(-tokens)
		ep.mem.Ended(tokens, m.ledger.BlockSize(ep.url), func() { m.ledger.Running(ep.url, -tokens) })
	}
}

// returned records that a turn looked key up: its conversation came
// back, whether its hold is live, released or expired.
func (m *decodeMemory) returned(key string) { m.ledger.Return(key, m.clock()) }

// close stops the background work: metrics reads and release requests in
// flight are cancelled.
func (m *decodeMemory) close() error {
	m.bg.stop()
	return nil
}

// What room a decode leg may make on arrival (memory.go, arrive). A leg
// is counted as what it can really take on its engine: its prompt and
// what it may generate, clipped to the engine's max_model_len (read from
// its GET /v1/models beside its /metrics; else its KV capacity). A request
// the engine will reject makes none: vLLM answers 400 when a request's
// max_tokens (chat: max_completion_tokens when given) is over
// max_model_len, or its prompt plus max_tokens is (TokenizeParams in
// vllm/renderers/params.py, with max_output_tokens from the request's
// build_tok_params). A turn makes room once, whatever legs it sends
// (turn.roomMade). And what one principal's requests release of other
// tenants' holds is rate-limited (DecodeMemory's RoomRate): a share of
// the engine's capacity per minute; its own tenant's holds are released
// for it without limit. So a client that asks for more than it uses
// (a huge max_tokens, again and again) cannot drain the holds of every
// tenant on an engine.

// liveTokens is what t's decode leg may take on an engine of max_model_len
// maxLen and capacity tokens (0: unknown): its prompt (as P's answer or
// the turn's verification counted it, counted; else its body's bytes /
// bytesPerToken) and what it may generate (max_completion_tokens,
// max_tokens or Responses' max_output_tokens, else defaultGeneration),
// clipped to maxLen, else to capacity. admit is false for a request the
// engine will reject: its limit over maxLen, or with a prompt counted
// exactly, prompt and limit together.
func liveTokens(t *turn, counted int, maxLen, capacity int64) (tokens int64, admit bool) {
	prompt, exact := int64(counted), true
	if prompt <= 0 {
		prompt, exact = int64(len(t.req.Body)/bytesPerToken), false
	}
	gen, asked := int64(defaultGeneration), false
	for _, k := range [...]string{"max_completion_tokens", "max_tokens", "max_output_tokens"} {
		if v, ok := t.req.Field(k); ok {
			if n, ok := jsonraw.Int(v); ok && n > 0 {
				gen, asked = n, true
				break
			}
		}
	}
	if maxLen > 0 && asked && (gen > maxLen || (exact && prompt+gen > maxLen)) {
		return 0, false
	}
	tokens = prompt + min(gen, 1<<40)
	if limit := maxLen; limit > 0 || capacity > 0 {
		if limit <= 0 {
			limit = capacity
		}
		tokens = min(tokens, limit)
	}
	return tokens, true
}

// makeRoom chooses the holds to release so that t's decode leg fits on ep,
// an engine of capacity tokens: the ledger's victims for the room the
// engine's live legs need, of which other tenants' holds only up to the
// turn's principal's allowance.
func makeRoom(m *decodeMemory, t *turn, ep *endpoint, capacity int64, now time.Time) []budget.Victim {
	principal := t.req.Principal()
	allow := m.limits.Allowance(principal, capacity, now)
	var limited bool
	victims := m.rel.chosen.choose(func() (v []budget.Victim) {
		v, limited = m.ledger.VictimsFor(ep.url, m.room(ep), t.req.tenant, allow, now)
		return v
	})
	if limited {
		m.stats.roomLimited.Add(1)
	}
	var others int64
	for _, v := range victims {
		if v.Other {
			others += int64(v.Tokens)
		}
	}
	m.limits.Charge(principal, others, capacity, now)
	return victims
}

// DecodeKV is the KV one decode engine holds for the live handles in this
// Router's ledger (retained by it, or by any Router sharing its
// DecodeMemory.Ledger; stored, not yet attached to a prefill request nor
// released; one past the retention TTL and not released is counted until
// the engine's decoder_kv_blocks_ttl, TTLs' DecoderBlocks, as the engine
// still pins it), with its budget and the
// pressure the router last read (WithDecodeMemory). It is the memory the
// retention TTL trades against the hit rate. A handle the Store dropped
// early (evicted, or replaced by a later turn of the same conversation)
// is counted until its TTL. Router replicas with ledgers of their own
// (in other processes) count only their own handles, unless their ledgers
// share a DecodeMemory.Journal.
type DecodeKV struct {
	// Endpoint is the decode endpoint (its URL).
	Endpoint string
	// Handles is the number of live retained handles on it.
	Handles int
	// Tokens is their remote_num_tokens, summed.
	Tokens int64
	// Bytes is Tokens × WithDecodeMemory's KVBytesPerToken, 0 when that is unset.
	Bytes int64
	// HeldTokens is the memory they pin, in whole blocks × the engine's
	// block size: what counts against the budget. In token verification
	// a block several holds share (a common prompt, stored once by the
	// engine's prefix cache) is counted once, to budget.PrefixGranule
	// tokens: never less than the engine holds.
	HeldTokens int64
	// Capacity is the engine's KV capacity in tokens (its /metrics, or
	// WithDecodeMemory's Capacity), 0 when unknown; Budget the share of it
	// the holds in the ledger may take (WithDecodeMemory's Budget), 0 when
	// there is none.
	Capacity, Budget int64
	// Unseen is the KV in use on the engine, at the last reading of its
	// /metrics, beyond this Router's holds and live decode legs
	// (vllm:kv_cache_usage_perc × Capacity, less both; 0 when unknown):
	// other routers' holds and requests, holds of streams whose answers
	// carry no handle, orphaned holds. The management counts it as used:
	// this Router's holds yield to it.
	Unseen int64
	// MaxModelLen is the engine's max_model_len (its GET /v1/models, read
	// beside its /metrics), 0 when unknown: the most a request may take
	// there, prompt and max_tokens together.
	MaxModelLen int64
	// Ages counts the handles by age, in the buckets of budget.AgeBounds
	// (up to 15 s, 30 s, 1, 2, 4 and 8 min) and one for older ones.
	Ages [7]int
	// KVUsage, Waiting and Preemptions are the engine's
	// vllm:kv_cache_usage_perc (0 to 1; -1 when it reports none),
	// vllm:num_requests_waiting and vllm:num_preemptions_total at the
	// router's last reading of its /metrics, at MetricsRead (zero: never
	// read).
	KVUsage     float64
	Waiting     int
	Preemptions int64
	MetricsRead time.Time
}

// DecodeKV returns, for every decode endpoint, the KV it holds for the
// live retained handles in this Router's ledger, in the endpoints' order. Endpoints that
// were removed but still hold handles follow.
func (r *Router) DecodeKV() []DecodeKV {
	now := r.cfg.clock()
	var out []DecodeKV
	for _, e := range r.decode.list() {
		d := DecodeKV{Endpoint: e.url}
		p := e.mem.Snapshot()
		if !p.At.IsZero() {
			d.KVUsage, d.Waiting, d.Preemptions, d.MetricsRead, d.Unseen = p.Usage, p.Waiting, int64(p.Preemptions), p.At, p.Unseen
		}
		d.MaxModelLen = p.MaxModelLen
		out = append(out, d)
	}
	var gone []DecodeKV
	for _, u := range r.mem.ledger.Usage(now) {
		d := DecodeKV{Endpoint: u.Engine}
		i := slices.IndexFunc(out, func(d DecodeKV) bool { return d.Endpoint == u.Engine })
		if i >= 0 {
			d = out[i]
		} else if u.Holds == 0 {
			continue
		}
		d.Handles, d.Tokens, d.HeldTokens = u.Holds, u.Tokens, u.HeldTokens
		d.Capacity, d.Budget = u.Capacity, u.Budget
		copy(d.Ages[:], u.Ages[:])
		if i >= 0 {
			out[i] = d
		} else {
			gone = append(gone, d)
		}
	}
	slices.SortFunc(gone, func(a, b DecodeKV) int {
		if a.Endpoint < b.Endpoint {
			return -1
		}
		if a.Endpoint > b.Endpoint {
			return 1
		}
		return 0
	})
	out = append(out, gone...)
	for i := range out {
		out[i].Bytes = out[i].Tokens * r.cfg.kvBytesPerToken
	}
	return out
}
