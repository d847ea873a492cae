package sim

import (
	"cmp"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"slices"
	"sync"
	"time"
)

// Failure policies of kv_load_failure_policy.
const (
	PolicyFail      = "fail"
	PolicyRecompute = "recompute"
)

// Roles an engine takes per request.
const (
	RolePrefill = "prefill"
	RoleDecode  = "decode"
	RolePlain   = "plain"
)

// Config configures an engine. DefaultConfig gives a NixlConnector engine
// with bidirectional_kv_xfer on, vLLM's defaults otherwise.
type Config struct {
	Model     string
	BlockSize int
	// NumBlocks is the KV pool's capacity in usable blocks of each
	// data-parallel rank (default 8192; at least 1). vLLM's num_gpu_blocks
	// (--num-gpu-blocks-override, vllm:cache_config_info) counts one more:
	// its null block, block 0, which holds nothing. Blocks held for a
	// remote reader count as used and are never evicted; a request waits
	// until its prompt fits and preempts others to grow (sched.go).
	NumBlocks int
	// MaxModelLen is --max-model-len: the most tokens a request may take,
	// prompt and max_tokens together (0: NumBlocks × BlockSize, the whole
	// pool). vLLM refuses to start when one request of max_model_len
	// tokens cannot fit in the KV pool, so it is at most NumBlocks ×
	// BlockSize. GET /v1/models lists it; a request over it gets vLLM's
	// 400 (contextLengthError).
	MaxModelLen int
	// MaxNumSeqs is --max-num-seqs: at most this many requests of a rank
	// run at once, the others wait (default 1024, vLLM's on GPUs of 70 GiB
	// or more such as H200; 0 means no limit). Requests loading KV from a
	// remote (WAITING_FOR_REMOTE_KVS) do not count: once read, they wait
	// for a slot.
	MaxNumSeqs          int
	PrefixCaching       bool
	StreamHandles       bool
	RecomputeThreshold  int
	DecoderBlocksTTL    time.Duration
	LeaseDuration       time.Duration
	KVLoadFailurePolicy string
	Profile             Profile
	Speed               float64
	TPSize              int
	SideHost            string // empty: Registry.NextAddr
	SidePort            int    // rank 0's; data-parallel rank k's is SidePort + k
	Reasoning           bool
	// InlineReasoning serves Reasoning without a reasoning parser: the
	// reply's content holds "<think>…</think>\n\n…" and no reasoning is
	// split out.
	InlineReasoning bool
	// ReasoningField names the reasoning key of messages and deltas:
	// ReasoningFieldReasoning (default, current vLLM; "" means the same),
	// ReasoningFieldContent (older engines) or ReasoningFieldBoth.
	ReasoningField string
	// KVGroups is the number of KV-cache groups (default 1; 0 means 1), as
	// an MLA or full-attention model with several groups has: handles carry
	// one list of block ids per group, all of equal length, and a reader
	// checks and reads every group.
	KVGroups int
	// GroupBlockSize and SlidingWindow make a hybrid model of KVGroups
	// groups (hybrid.go): the groups after the first hold sliding-window
	// layers of SlidingWindow tokens (0: full attention) in blocks of
	// GroupBlockSize tokens (0: BlockSize; else a multiple of it, as vLLM
	// raises the block size of a group with smaller pages). Their handle
	// lists are shorter than the first group's: blocks of their size,
	// clipped to the window's tail.
	GroupBlockSize, SlidingWindow int
	// DriftRate is the probability per reply (0 to 1, decided from the KV,
	// so Reference reproduces it) that one content word is emitted as two
	// tokens whose text re-tokenizes to one (BPE drift).
	DriftRate float64
	// ToolCallRate is the probability per reply (0 to 1, decided from the
	// KV, so Reference reproduces it) that a reply under tool_choice auto
	// ends in a call of one of the request's tools where it would end
	// (toolcall.go): the model's propensity to call tools. DefaultConfig
	// sets DefaultToolCallRate; 0 means replies never call under auto.
	ToolCallRate float64
	// Template is the chat template family: TemplateChatML (default; ""
	// means the same) or TemplateLlama3.
	Template string
	// ContentFormat is how text parts reach the template:
	// ContentFormatString (default; "" means the same) or
	// ContentFormatOpenAI.
	ContentFormat string
	// DecodeRecompute makes kv_recompute_threshold guard D's pull too, as
	// vLLM PR #55801 does (_should_recompute_remote_kv on the
	// remote-prefill path): D computes locally instead of pulling fewer
	// tokens than the threshold, and still notifies P (off by default, as
	// released engines).
	DecodeRecompute bool
	// PrefillHandleOnLengthOnly is an older engine's P: it emits its handle
	// only when the request stopped on max_tokens, not on a normal stop
	// (EOS or a stop string) as current vLLM does.
	PrefillHandleOnLengthOnly bool
	// Bidirectional is kv_connector_extra_config.bidirectional_kv_xfer:
	// when false D emits no handle and P ignores D handles. vLLM's default
	// is false (NixlBaseConnectorScheduler.__init__); DefaultConfig sets it.
	Bidirectional bool
	// NoKVConnector is an engine started without --kv-transfer-config:
	// the scheduler has no KV connector (Scheduler.__init__ leaves
	// self.connector None), so kv_transfer_params are ignored on every API
	// (the request is served as a plain one: no read, no hold, no
	// notification) and every answer's kv_transfer_params is null.
	// DefaultConfig leaves it false: a NixlConnector engine.
	NoKVConnector bool
	// Render is the render endpoints' mode: RenderEnabled (default; ""
	// means the same), RenderDisabled (501) or RenderAbsent (404).
	Render string
	// DPSize is --data-parallel-size (default 1; 0 means 1): the number of
	// data-parallel ranks, each an engine core with its own NIXL engine id
	// (vLLM's "<id>_dp<k>" when DPSize > 1), its own block pool and held
	// handles, and its own side channel at SidePort + k. A request's
	// X-data-parallel-rank header pins it to a rank (out of range: 400);
	// otherwise ranks take requests in turn.
	DPSize int
	// StrictRank checks X-data-parallel-rank when DPSize is 1 too, as vLLM
	// does (any rank but 0 is out of range). Off by default: a one-rank
	// engine ignores the header.
	StrictRank bool
	// PromptTokensDetails is vLLM's --enable-prompt-tokens-details: chat
	// and completions usage carries prompt_tokens_details.cached_tokens,
	// the request's num_cached_tokens (its computed tokens at its first
	// schedule: prefix-cache hits and what a connector loaded, a pull or
	// the CPU tier). Off (vLLM's default): prompt_tokens_details is null.
	PromptTokensDetails bool
	// Fingerprint is the system_fingerprint mode: FingerprintAbsent
	// (default; "" means the same: no system_fingerprint key, an engine
	// older than vLLM's --fingerprint-mode), FingerprintFull (vLLM's
	// default), FingerprintHash, FingerprintCustom (FingerprintValue) or
	// FingerprintNone (null).
	Fingerprint string
	// FingerprintValue is --fingerprint-value, the fingerprint of
	// FingerprintCustom.
	FingerprintValue string
	// EngineID is kv_transfer_config's engine_id: the NIXL engine id in
	// handles, kept across a restart (with several data-parallel ranks,
	// rank k's is EngineID + "_dp<k>"). Empty (vLLM's default) draws a
	// random one at every start.
	EngineID string
	// Version is what GET /version answers ({"version": Version}, as
	// vLLM's api_server does). Default DefaultVersion; empty: the route
	// answers 404, as a server without it.
	Version string
	// NoTokenize makes POST /tokenize answer 404 {"detail": "Not Found"}, a
	// server without the route (default false: served).
	NoTokenize bool
	// NoResponsesKV and NoMessagesKV are an engine older than vLLM PR
	// #37424 (Responses) or #37535 (Messages): the API's request model has
	// no kv_transfer_params, so the field is ignored (the request is
	// served as a plain one) and the response carries no such key. Default
	// false: accepted and returned.
	NoResponsesKV, NoMessagesKV bool
	// UsageMetric names the KV usage gauge of GET /metrics:
	// UsageMetricCurrent (default; "" means the same:
	// vllm:kv_cache_usage_perc), UsageMetricLegacy (engines before 0.9:
	// vllm:gpu_cache_usage_perc) or UsageMetricBoth (0.9 and 0.10 wrote
	// both).
	UsageMetric string
	// CPUTier adds vLLM's OffloadingConnector behind the NixlConnector
	// (MultiConnector, NIXL first), with its optional peer tier
	// (cputier.go, cpuload.go). The zero value: no CPU tier.
	CPUTier  CPUTier
	Clock    Clock     // nil: real time
	Registry *Registry // nil: a private registry
	Logger   *slog.Logger
}

// DefaultVersion is the vLLM version an engine reports by default.
const DefaultVersion = "0.30.0"

// DefaultConfig returns an engine started as this project deploys vLLM:
// --kv-transfer-config '{"kv_connector":"NixlConnector","kv_role":"kv_both",
// "kv_connector_extra_config":{"bidirectional_kv_xfer":true}}' and vLLM's
// defaults for the rest: sim-model, 16-token blocks, 8192 blocks, 1024
// running requests, prefix caching on, stock streams, threshold 64 (vLLM's
// default with bidirectional transfer on), TTL 480 s, lease 30 s, policy
// fail, zero-cost profile, speed 0, TP 1, DP 1, no system_fingerprint,
// version DefaultVersion, /tokenize and kv_transfer_params on every API,
// tool call rate DefaultToolCallRate. vLLM's own defaults differ in
// Bidirectional (false) and RecomputeThreshold (0 when bidirectional is
// off), and without --kv-transfer-config in NoKVConnector (true):
// examples/vllmsim starts from those.
func DefaultConfig() Config {
	return Config{
		Model:               "sim-model",
		BlockSize:           16,
		NumBlocks:           8192,
		MaxNumSeqs:          1024,
		Version:             DefaultVersion,
		PrefixCaching:       true,
		RecomputeThreshold:  64,
		DecoderBlocksTTL:    480 * time.Second,
		LeaseDuration:       30 * time.Second,
		KVLoadFailurePolicy: PolicyFail,
		TPSize:              1,
		Bidirectional:       true,
		Render:              RenderEnabled,
		DPSize:              1,
		Template:            TemplateChatML,
		ContentFormat:       ContentFormatString,
		ReasoningField:      ReasoningFieldReasoning,
		ToolCallRate:        DefaultToolCallRate,
	}
}

// DefaultToolCallRate is DefaultConfig's ToolCallRate: half the replies
// under tool_choice auto call a tool.
const DefaultToolCallRate = 0.5

// ErrInvalidConfig reports a configuration the engine refuses.
var ErrInvalidConfig = errors.New("sim: invalid config")

// maxModelLen is --max-model-len: MaxModelLen, else the whole KV pool.
func (c *Config) maxModelLen() int {
	if c.MaxModelLen > 0 {
		return c.MaxModelLen
	}
	return c.NumBlocks * c.BlockSize
}

func (c *Config) validate() error {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, a...)...)
	}
	switch {
	case c.Model == "":
		return bad("model must not be empty")
	case c.BlockSize < 1:
		return bad("block size %d must be at least 1", c.BlockSize)
	case c.NumBlocks < 1:
		return bad("number of blocks %d must be at least 1", c.NumBlocks)
	case c.MaxModelLen < 0 || c.MaxModelLen > c.NumBlocks*c.BlockSize:
		return bad("max model len %d must be in [0, %d] (the KV pool's tokens: vLLM refuses to start when one request of max_model_len does not fit)", c.MaxModelLen, c.NumBlocks*c.BlockSize)
	case c.MaxNumSeqs < 0:
		return bad("max num seqs %d must be >= 0", c.MaxNumSeqs)
	case !oneOf(c.UsageMetric, UsageMetricCurrent, UsageMetricLegacy, UsageMetricBoth):
		return bad("usage metric %q must be %q, %q or %q", c.UsageMetric, UsageMetricCurrent, UsageMetricLegacy, UsageMetricBoth)
	case c.RecomputeThreshold < 0:
		return bad("recompute threshold %d must be >= 0", c.RecomputeThreshold)
	case c.DecoderBlocksTTL <= 0:
		return bad("decoder blocks TTL must be positive")
	case c.LeaseDuration <= 0:
		return bad("lease duration must be positive")
	case c.KVLoadFailurePolicy != PolicyFail && c.KVLoadFailurePolicy != PolicyRecompute:
		return bad("kv_load_failure_policy %q must be %q or %q", c.KVLoadFailurePolicy, PolicyFail, PolicyRecompute)
	case c.Speed < 0:
		return bad("speed %v must be >= 0", c.Speed)
	case c.KVGroups < 0:
		return bad("kv groups %d must be >= 0", c.KVGroups)
	case c.GroupBlockSize < 0 || c.GroupBlockSize%c.BlockSize != 0:
		return bad("group block size %d must be a multiple of the block size %d (vLLM raises a group's block size by its page ratio)", c.GroupBlockSize, c.BlockSize)
	case c.SlidingWindow < 0:
		return bad("sliding window %d must be >= 0", c.SlidingWindow)
	case c.hybrid() && c.KVGroups < 2:
		return bad("a group block size or sliding window needs at least 2 KV groups (the first is full attention)")
	case c.DriftRate < 0 || c.DriftRate > 1:
		return bad("drift rate %v must be between 0 and 1", c.DriftRate)
	case !(c.ToolCallRate >= 0 && c.ToolCallRate <= 1):
		return bad("tool call rate %v must be between 0 and 1", c.ToolCallRate)
	case c.TPSize < 1:
		return bad("tp size %d must be at least 1", c.TPSize)
	case c.DPSize < 0:
		return bad("dp size %d must be at least 1", c.DPSize)
	case c.SidePort < 0 || c.SidePort+c.dp()-1 > 65535:
		return bad("side-channel ports %d to %d out of range", c.SidePort, c.SidePort+c.dp()-1)
	case !oneOf(c.Fingerprint, FingerprintAbsent, FingerprintFull, FingerprintHash, FingerprintCustom, FingerprintNone):
		return bad("fingerprint mode %q must be %q, %q, %q, %q or %q", c.Fingerprint, FingerprintAbsent, FingerprintFull, FingerprintHash, FingerprintCustom, FingerprintNone)
	case !oneOf(c.Template, TemplateChatML, TemplateLlama3):
		return bad("template %q must be %q or %q", c.Template, TemplateChatML, TemplateLlama3)
	case !oneOf(c.ContentFormat, ContentFormatString, ContentFormatOpenAI):
		return bad("content format %q must be %q or %q", c.ContentFormat, ContentFormatString, ContentFormatOpenAI)
	case !oneOf(c.ReasoningField, ReasoningFieldReasoning, ReasoningFieldContent, ReasoningFieldBoth):
		return bad("reasoning field %q must be %q, %q or %q", c.ReasoningField, ReasoningFieldReasoning, ReasoningFieldContent, ReasoningFieldBoth)
	case c.CPUTier.Chunks < 0 || c.CPUTier.BlocksPerChunk < 0:
		return bad("cpu tier chunks %d and blocks per chunk %d must be >= 0", c.CPUTier.Chunks, c.CPUTier.BlocksPerChunk)
	case !oneOf(c.CPUTier.HashAlgo, HashSHA256, HashXXHash):
		return bad("prefix caching hash algo %q must be %q or %q", c.CPUTier.HashAlgo, HashSHA256, HashXXHash)
	case c.CPUTier.P2P && !c.CPUTier.enabled():
		return bad("a peer tier needs a CPU tier (CPUTier.Chunks > 0)")
	case c.CPUTier.P2PPort < 0 || c.CPUTier.p2pPort()+c.dp()-1 > 65535:
		return bad("peer-tier ports %d to %d out of range", c.CPUTier.p2pPort(), c.CPUTier.p2pPort()+c.dp()-1)
	case c.Render != "" && c.Render != RenderEnabled && c.Render != RenderDisabled && c.Render != RenderAbsent:
		return bad("render mode %q must be %q, %q or %q", c.Render, RenderEnabled, RenderDisabled, RenderAbsent)
	}
	return nil
}

// oneOf reports whether v is "" or one of the allowed values.
func oneOf(v string, allowed ...string) bool {
	if v == "" {
		return true
	}
	for _, a := range allowed {
		if v == a {
			return true
		}
	}
	return false
}

// Stats are an engine's counters. See kvroutetest.Stats for their meaning.
type Stats struct {
	Requests, PrefillRequests, DecodeRequests, PlainRequests int
	TokensComputed, TokensPulledIn, TokensPulledOut          int
	PrefixHitTokens                                          int
	FreedReads, ExpiredReads                                 int
	WrongOutputs                                             int
	BlocksPinned, FreeBlocks                                 int
	Aborted, HandlesEmitted                                  int
	LoadFailures, DeclinedReads, Recomputed                  int
	LeaseExpiries, TTLExpiries                               int
	Errors, Restarts                                         int
	// AssertFailures counts reads that tripped the worker's assert
	// len(local) <= len(remote) on a KV group (or a group count that does
	// not match): the request got 500 and the engine restarted.
	AssertFailures int
	// PoisonedHits counts prefix-cache hits whose cached KV differs from
	// the correct KV for their tokens (a bad positional read cached under
	// this engine's token hashes).
	PoisonedHits int
	// RenderRequests counts calls to the render endpoints, TokenizeRequests
	// calls to /tokenize and /v1/messages/count_tokens (neither counts in
	// Requests).
	RenderRequests, TokenizeRequests int
	// TotalBlocks is the pool's usable capacity (NumBlocks per rank);
	// UsedBlocks are allocated now (running requests and holds), the rest
	// free or evictable. Running and Waiting are vllm:num_requests_running
	// and vllm:num_requests_waiting (a request loading from a remote is
	// waiting, and takes no running slot).
	TotalBlocks, UsedBlocks, Running, Waiting int
	// Queued counts requests that had to wait for blocks (or for a running
	// slot) before they were first scheduled; Preemptions the preemptions
	// (vllm:num_preemptions_total); TokensRecomputed the tokens recomputed
	// after them.
	Queued, Preemptions, TokensRecomputed int
	// Holds counts handles emitted whose blocks were held (P for the
	// lease, D for decoder_kv_blocks_ttl). NotifiedHolds counts holds freed
	// by a reader's notification and NotifiedBlocks their blocks;
	// TTLBlocks and LeaseBlocks count blocks freed by expiry (TTLExpiries
	// and LeaseExpiries count those holds); StaleNotifies counts
	// notifications for a hold unknown or already freed, which change
	// nothing.
	Holds, NotifiedHolds, NotifiedBlocks, TTLBlocks, LeaseBlocks, StaleNotifies int
	// The CPU tier (Config.CPUTier), summed over ranks: chunks written
	// through (CPUChunksStored), evicted, and store batches skipped for
	// want of room (CPUStoreFailures, vllm:kv_offload_allocation_failure);
	// chunks loaded to the GPU (CPUChunksLoaded), of them promoted from a
	// peer (CPUChunksFromPeer); requests that asked a peer (CPUPeerPulls),
	// of them those whose lookup ended on a miss before the prompt's last
	// whole chunk (CPUPeerMisses), and handshakes rejected
	// (CPUPeerRejects); chunks resident now and the capacity; as a source,
	// chunks peers fetched (CPUChunksServed).
	CPUChunksStored, CPUChunksEvicted, CPUStoreFailures   int
	CPUChunksLoaded, CPUChunksFromPeer                    int
	CPUPeerPulls, CPUPeerMisses, CPUPeerRejects           int
	CPUChunksResident, CPUChunksCapacity, CPUChunksServed int
	// ModelsCompute is whether the engine's answers take its cost
	// profile's modelled time in real time (a profile, a speed above 0,
	// the real clock). False: what a client measures of its answers holds
	// no engine compute (bidikv-proxy doctor says so of its TTFTs).
	ModelsCompute bool
}

// Record describes one request. See kvroutetest.RequestRecord.
type Record struct {
	Path             string
	Header           http.Header
	Body             []byte
	RequestID        string
	EngineRequestID  string
	Role             string
	PromptTokens     int
	CachedTokens     int
	ComputedTokens   int
	PulledTokens     int
	CompletionTokens int
	Pull             string
	Prefill          time.Duration
	Transfer         time.Duration
	Decode           time.Duration
	Status           int
	Finish           string
	Aborted          bool
	Wrong            bool
	Poisoned         bool
	Handle           json.RawMessage
	Error            string
	// Rank is the data-parallel rank that served the request (0 when the
	// engine has one rank or the request was rejected before a rank was
	// chosen).
	Rank int
	// Queued is the time the request waited for blocks (or a running
	// slot) before it was first scheduled, and after a read from a remote
	// for a running slot; Preemptions counts its
	// preemptions, Requeued the time it waited after them and Recompute
	// the modelled recomputation of its prompt and generated tokens after
	// them. FirstToken is the modelled time from arrival to the end of its
	// prefill: Queued + Transfer + Prefill, and whatever preemptions cost
	// before it (on an event clock or in scaled real time, what passed on
	// the clock: a preemption may cut a prefill short). Times are on the
	// engine's clock (real time times Speed when modelled work passes in
	// scaled real time).
	Queued, Requeued, Recompute, FirstToken time.Duration
	Preemptions                             int
	// TierTokens are the prompt tokens loaded from the CPU tier after the
	// GPU prefix-cache hit, PeerTokens those of them promoted from a
	// peer's CPU tier (both priced in Transfer).
	TierTokens, PeerTokens int

	finished bool // finish ran: the record no longer changes (e.mu)
}

type heldState int

const (
	heldActive heldState = iota
	heldFreed
	heldExpired
)

// held is a handle's blocks kept for a remote reader.
type held struct {
	id       string // the request id the reader names
	seq      *seq
	deadline time.Time
	decode   bool // TTL (decode) rather than lease (prefill)
	state    heldState
	order    uint64 // creation order, for a fixed expiry order
}

// Engine is one simulated vLLM server. It is an http.Handler and the Peer
// its side channel serves. Safe for concurrent use.
type Engine struct {
	cfg   Config
	clock Clock
	mode  clockMode
	reg   *Registry
	log   *slog.Logger

	peers []Peer         // rank k's side channel; peers[0] is e
	p2p   []*p2pEndpoint // rank k's peer-tier port (CPUTier.P2P)

	mu         sync.Mutex
	ranks      []*rank
	nextRank   int // round-robin cursor
	start      time.Time
	monoOffset float64
	stats      Stats
	records    []*Record
	failN      int
	failStatus int
	cutAfter   int // -1: none armed
	stall      time.Duration
	closed     bool
}

// New starts an engine and registers its side channels, one per
// data-parallel rank at SidePort + rank.
func New(cfg Config) (*Engine, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	e := &Engine{cfg: cfg, clock: cfg.Clock, reg: cfg.Registry, log: cfg.Logger, cutAfter: -1}
	if e.clock == nil {
		e.clock = realClock{}
	}
	e.mode = e.clockMode()
	if e.reg == nil {
		e.reg = NewRegistry()
	}
	if e.log == nil {
		e.log = slog.New(slog.DiscardHandler)
	}
	if e.cfg.SideHost == "" {
		e.cfg.SideHost, e.cfg.SidePort = e.reg.NextAddr()
	}
	e.reset()
	e.peers = make([]Peer, e.cfg.dp())
	for k := range e.peers {
		e.peers[k] = &rankPeer{e: e, k: k}
	}
	e.peers[0] = e
	for k, p := range e.peers {
		if err := e.reg.Register(e.cfg.SideHost, e.cfg.SidePort+k, p); err != nil {
			for j := range k {
				e.reg.Unregister(e.cfg.SideHost, e.cfg.SidePort+j, e.peers[j])
			}
			return nil, err
		}
	}
	if err := e.registerP2P(); err != nil {
		for k, p := range e.peers {
			e.reg.Unregister(e.cfg.SideHost, e.cfg.SidePort+k, p)
		}
		return nil, err
	}
	return e, nil
}

// reset starts the engine's process again: a fresh start time
// (process_start_time_seconds), monotonic clock and engine id (unless
// Config.EngineID fixes it), and every rank an empty pool: block ids a
// handle of the previous process names now hold other content. e.mu held
// or not yet shared.
func (e *Engine) reset() {
	base := e.cfg.EngineID
	if base == "" {
		base = "sim-" + randHex(6)
	}
	e.start = e.clock.Now()
	e.monoOffset = float64(1000 + randUint()%90000)
	for _, r := range e.ranks {
		// the old process's waiting requests die with it
		for _, t := range append(r.waiting, r.loaded...) {
			t.state = stateDead
			e.wakeTurn(t)
		}
		r.waiting, r.loaded = nil, nil
		if r.stepStop != nil {
			r.stepStop()
			r.stepStop = nil
		}
		if r.expiryStop != nil {
			r.expiryStop()
			r.expiryStop = nil
		}
	}
	e.ranks = make([]*rank, e.cfg.dp())
	seed := noneHashSeed(e.cfg.CPUTier)
	for k := range e.ranks {
		id := base
		if len(e.ranks) > 1 {
			// vLLM suffixes each data-parallel engine core's id
			id = fmt.Sprintf("%s_dp%d", base, k)
		}
		e.ranks[k] = &rank{id: id, pool: newPool(e.cfg.NumBlocks, e.cfg.BlockSize, e.cfg.PrefixCaching),
			held: map[string]*held{}, active: map[string]*held{}}
		if e.cfg.CPUTier.enabled() {
			// the process's pinned CPU memory and its hash seed die with it
			e.ranks[k].tier = newCPUTier(e.cfg.CPUTier, e.cfg.BlockSize, seed)
		}
	}
}

func randHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

func randUint() uint64 {
	var b [8]byte
	_, _ = rand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

// Close unregisters the side channels.
func (e *Engine) Close() {
	e.mu.Lock()
	e.closed = true
	e.mu.Unlock()
	for k, p := range e.peers {
		e.reg.Unregister(e.cfg.SideHost, e.cfg.SidePort+k, p)
	}
	for k, p := range e.p2p {
		e.reg.Unregister(e.cfg.SideHost, e.cfg.CPUTier.p2pPort()+k, p)
	}
}

// Config returns the engine's configuration.
func (e *Engine) Config() Config { return e.cfg }

// EngineID returns rank 0's current engine id (it changes on Restart).
func (e *Engine) EngineID() string { return e.RankEngineID(0) }

// RankEngineID returns data-parallel rank k's current engine id: the
// engine's id, suffixed "_dp<k>" when it has more than one rank. It panics
// when k is out of range.
func (e *Engine) RankEngineID(k int) string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.ranks[k].id
}

// SideChannel returns the side-channel address put in rank 0's handles.
func (e *Engine) SideChannel() (string, int) { return e.RankSideChannel(0) }

// RankSideChannel returns the side-channel address put in rank k's
// handles: the base port plus k.
func (e *Engine) RankSideChannel(k int) (string, int) { return e.cfg.SideHost, e.cfg.SidePort + k }

// DPSize returns the number of data-parallel ranks.
func (e *Engine) DPSize() int { return len(e.peers) }

// RankPeer returns rank k's side channel (RankPeer(0) is e). It panics when
// k is out of range.
func (e *Engine) RankPeer(k int) Peer { return e.peers[k] }

// StartTime returns when the engine's current process started: its
// process_start_time_seconds on GET /metrics.
func (e *Engine) StartTime() time.Time {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.start
}

// Mono returns the engine's monotonic clock in seconds (arbitrary offset).
func (e *Engine) Mono() float64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.mono(e.clock.Now())
}

func (e *Engine) mono(now time.Time) float64 {
	return e.monoOffset + now.Sub(e.start).Seconds()
}

// Stats returns a snapshot of the counters, summed over the data-parallel
// ranks, after freeing whatever expired.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.sweep(e.clock.Now())
	s := e.stats
	s.ModelsCompute = e.mode == modeReal && e.cfg.Profile != (Profile{})
	s.FreeBlocks, s.BlocksPinned = 0, 0
	for _, r := range e.ranks {
		s.FreeBlocks += r.pool.freeCount()
		s.TotalBlocks += r.pool.size()
		s.UsedBlocks += r.pool.size() - r.pool.freeCount()
		s.Running += r.slots()
		s.Waiting += len(r.waiting) + len(r.loaded) + r.pulls
		pinned := map[*block]bool{} // holds may share prefix-cached blocks
		for _, h := range r.active {
			for _, b := range h.seq.blocks {
				pinned[b] = true
			}
		}
		s.BlocksPinned += len(pinned)
		if c := r.tier; c != nil {
			s.CPUChunksStored += c.stored
			s.CPUChunksEvicted += c.evicted
			s.CPUStoreFailures += c.failures
			s.CPUChunksLoaded += c.loadedLocal
			s.CPUChunksFromPeer += c.loadedPeer
			s.CPUPeerPulls += c.peerPulls
			s.CPUPeerMisses += c.peerMisses
			s.CPUPeerRejects += c.peerRejects
			s.CPUChunksResident += len(c.chunks)
			s.CPUChunksCapacity += c.capacity
			s.CPUChunksServed += c.servedChunks
		}
	}
	return s
}

// Records returns a copy of every request record, in arrival order.
func (e *Engine) Records() []Record {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]Record, len(e.records))
	for i, r := range e.records {
		out[i] = *r
		out[i].Header = r.Header.Clone()
		out[i].Body = append([]byte(nil), r.Body...)
		out[i].Handle = append(json.RawMessage(nil), r.Handle...)
	}
	return out
}

// FinishedRecords returns copies of the records of requests with
// X-Request-Id id that have ended. Unlike Records it is safe to call while
// other requests are being served, whose records are still being written.
func (e *Engine) FinishedRecords(id string) []Record {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []Record
	for _, r := range e.records {
		if !r.finished || r.RequestID != id {
			continue
		}
		c := *r
		c.Header = r.Header.Clone()
		c.Body = append([]byte(nil), r.Body...)
		c.Handle = append(json.RawMessage(nil), r.Handle...)
		out = append(out, c)
	}
	return out
}

// FailNext makes the next n completion requests answer status.
func (e *Engine) FailNext(n, status int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.failN, e.failStatus = n, status
}

// CutStreamAfter cuts the next streaming response after k events.
func (e *Engine) CutStreamAfter(k int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.cutAfter = k
}

// Stall makes the next completion request wait d (real time) before
// answering.
func (e *Engine) Stall(d time.Duration) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.stall = d
}

// Restart loses every block and handle of every rank, as a restarted
// process does: a new start time, and a new engine id unless
// Config.EngineID fixes it; the addresses stay.
func (e *Engine) Restart() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reset()
	e.stats.Restarts++
}

func (e *Engine) groups() int { return max(e.cfg.KVGroups, 1) }

// sweep frees held blocks whose lease or TTL ran out, on every rank, in
// the order they expired (the free queue's order decides which cached
// blocks are evicted first); e.mu held.
func (e *Engine) sweep(now time.Time) {
	for _, r := range e.ranks {
		var due []*held
		for _, h := range r.active {
			if !now.Before(h.deadline) {
				due = append(due, h)
			}
		}
		slices.SortFunc(due, func(a, b *held) int {
			if c := a.deadline.Compare(b.deadline); c != 0 {
				return c
			}
			return cmp.Compare(a.order, b.order)
		})
		for _, h := range due {
			n := len(h.seq.blocks)
			r.end(h, heldExpired)
			if h.decode {
				e.stats.TTLExpiries++
				e.stats.TTLBlocks += n
			} else {
				e.stats.LeaseExpiries++
				e.stats.LeaseBlocks += n
			}
		}
	}
}

// Meta implements Peer: rank 0's handshake.
func (e *Engine) Meta(ctx context.Context) (string, float64, error) { return e.meta(ctx, 0) }

// Read implements Peer: a read from rank 0 (see rankPeer.Read).
func (e *Engine) Read(ctx context.Context, engineID, requestID string, blocks []int, tokens int) ([][]uint64, error) {
	return e.read(ctx, 0, engineID, requestID, blocks, tokens)
}

// Notify implements Peer: a notification to rank 0.
func (e *Engine) Notify(ctx context.Context, engineID, requestID string) error {
	return e.notify(ctx, 0, engineID, requestID)
}

func (e *Engine) meta(_ context.Context, k int) (string, float64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return "", 0, ErrUnreachable
	}
	return e.ranks[k].id, e.mono(e.clock.Now()), nil
}

// read is a raw positional read of rank k's blocks, counted as a read of
// freed or expired blocks when the handle is no longer held.
func (e *Engine) read(_ context.Context, k int, engineID, requestID string, blocks []int, tokens int) ([][]uint64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrUnreachable
	}
	r := e.ranks[k]
	if engineID != r.id {
		return nil, ErrEngineID
	}
	e.sweep(e.clock.Now())
	data, err := r.pool.readBlocks(blocks, e.groups())
	if err != nil {
		return nil, err
	}
	switch h, ok := r.held[requestID]; {
	case !ok || h.state == heldFreed:
		e.stats.FreedReads++
	case h.state == heldExpired:
		e.stats.ExpiredReads++
	}
	e.stats.TokensPulledOut += tokens
	return data, nil
}

// notify frees the blocks rank k holds for requestID: the handle was
// consumed.
func (e *Engine) notify(_ context.Context, k int, engineID, requestID string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrUnreachable
	}
	r := e.ranks[k]
	if engineID != r.id {
		return ErrEngineID
	}
	e.sweep(e.clock.Now())
	h, ok := r.held[requestID]
	if !ok || h.state != heldActive {
		// unknown, expired or freed already: nothing happens
		e.stats.StaleNotifies++
		return nil
	}
	e.stats.NotifiedHolds++
	e.stats.NotifiedBlocks += len(h.seq.blocks)
	r.end(h, heldFreed)
	e.schedule(r)
	return nil
}

// Heartbeat implements Peer: rank 0's lease renewal.
func (e *Engine) Heartbeat(ctx context.Context, engineID, requestID string) error {
	return e.heartbeat(ctx, 0, engineID, requestID)
}

// heartbeat renews the lease of the blocks rank k holds for a decoder that
// is still waiting to read them: kv_lease_duration from now. Holds for a
// prefill reader (D's, on the TTL) are not renewed.
func (e *Engine) heartbeat(_ context.Context, k int, engineID, requestID string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrUnreachable
	}
	r := e.ranks[k]
	if engineID != r.id {
		return ErrEngineID
	}
	e.sweep(e.clock.Now())
	if h, ok := r.held[requestID]; ok && h.state == heldActive && !h.decode {
		if d := e.clock.Now().Add(e.cfg.LeaseDuration); d.After(h.deadline) {
			h.deadline = d
		}
	}
	return nil
}

var _ Peer = (*Engine)(nil)
