package kvroute

import (
	"time"

	"github.com/bidikv/bidikv/retention/budget"
	"github.com/bidikv/bidikv/transport"
)

// VerificationMode selects how the router proves that a retained handle's
// KV is the KV the next prompt needs (docs/kvroute.md, Verification).
type VerificationMode string

// The verification modes, each one file (verify_*.go) registered in
// verifications.
const (
	// VerifyTokens compares tokens: the decode leg asks the engine for token
	// ids (return_token_ids), a compact fingerprint of the sequence D's
	// blocks hold is kept with the handle, and before a prefill leg the new
	// prompt is rendered by an engine (POST .../render, or /tokenize) and
	// compared with it. Only the verified common prefix is attached. It is
	// exact: no answer can differ from a single engine's. The default.
	VerifyTokens VerificationMode = "tokens"
	// VerifyContent compares content: a handle is used only when the request
	// resends exactly the stored conversation and reply (ContinuationKeys'
	// digests), and turns whose next render may differ (reasoning output,
	// stop strings, ...) are not retained. It needs no engine support, but it
	// cannot see what a chat template or tokenizer does to the text (see
	// docs/how-it-works.md, Limitations).
	VerifyContent VerificationMode = "content"
)

// defaultBlockSize is the fingerprint's block size for a decode engine
// whose block size is unknown (vLLM's --block-size default on CUDA).
const defaultBlockSize = 16

// Verification is how reuse is verified.
type Verification struct {
	// Mode is VerifyTokens (the default) or VerifyContent. In token mode,
	// a turn whose engine sends no token ids or serves no render endpoint
	// falls back to content verification with all of its refusals; the
	// fallback is logged once and counted in Stats.TokenFallbacks.
	Mode VerificationMode
	// BlockSize is the KV block size (vLLM's --block-size) of engines that
	// do not report theirs. The router reads each engine's from its
	// /metrics (vllm:cache_config_info) and uses it for that engine's
	// handles: their block-count check, and the partial reads of token
	// verification, which attach only a verified prefix of a handle
	// (remote_num_tokens lowered to a multiple of the size, every KV group's
	// remote_block_ids cut from the front). An engine that reports another
	// size is used at its own (logged once). Default 0: none; an engine that
	// reports no size then has its handles' block counts unchecked and
	// never read in part. A handle whose block count does not fit the size
	// is never cut (Stats.PartialRefused), nor used (Stats.UnvalidatedHandles).
	BlockSize int
}

// WithVerification sets how reuse is verified. A zero field keeps its
// default; a negative BlockSize disables partial reads (a handle is then
// attached only when the new prompt begins with its whole sequence). A
// Mode that is not a registered mode is an error.
func WithVerification(v Verification) Option {
	return optionFunc(func(c *config) { c.verify = v })
}

func resolveVerification(c *config) {
	v := c.verify
	c.verification = v.Mode
	if c.verification == "" {
		c.verification = VerifyTokens
	}
	if _, ok := verifications[c.verification]; !ok {
		c.fail("WithVerification", "Mode %q is not a mode; use kvroute.VerifyTokens or kvroute.VerifyContent", v.Mode)
	}
	c.blockSize, c.noPartial = max(v.BlockSize, 0), v.BlockSize < 0
}

// DecodeMemory is what the router does with the decode engines' KV memory
// beyond the pulls: answer turns from it (decode-local turns), keep it for
// streaming clients whose streams carry no handle (buffered streams),
// report it (DecodeKV), and manage what its retained handles hold there as
// a budget (docs/kvroute.md, Decode memory): release what will not be used,
// cap what is held, place by pressure. The management is one switch,
// Budget's sign, so that a benchmark can run it beside holding everything.
type DecodeMemory struct {
	// Local lets a turn whose retained handle was verified by tokens run
	// decode-local (docs/kvroute.md, Decode-local turns): as a plain request
	// to the decode engine that holds the conversation, which computes
	// only the new suffix from its own prefix cache. The
	// WithThresholdPolicy policy decides per turn when it is a
	// threshold.Chooser (threshold.CostModel is one); otherwise a
	// threshold.CostModel with its defaults and WithThreshold does. Turn
	// it on only when the decode engines run with prefix caching (vLLM's
	// default, --enable-prefix-caching): the router cannot see it, and a
	// decode engine without it recomputes the whole prompt (the answer is
	// still right, but slow, until the cost model learns it). The
	// decode-local leg goes to the engine that holds the handle, whatever
	// the Selector would pick; when that engine is ejected the turn pulls
	// as usual. A learning Chooser (threshold.Learner) is told each
	// streaming turn's observed times on the router's clock. It needs
	// WithVerification's Mode VerifyTokens (the default): with another
	// mode New returns an error. Default false.
	Local bool
	// KVBytesPerToken is the bytes of KV one token takes on the decode
	// engines (layers × KV heads × head dim × 2 × dtype bytes), for
	// DecodeKV.Bytes. Default 0: unknown, Bytes stays 0.
	KVBytesPerToken int64
	// BufferStreams lists the APIs, by path (PathChatCompletions,
	// PathCompletions, PathMessages), whose streamed turns run their decode
	// leg non-streaming when the decode engine's streams of that API carry
	// no handle (docs/kvroute.md, Wire protocol, step 5): the answer's body carries
	// D's handle, which is retained, and the router writes the answer to
	// the client as the API's own stream once it has arrived. The trade:
	// the first token arrives with the last (the turn's TTFT is its whole
	// decode), and every later turn reuses KV; it suits headless agents,
	// whose whole turn's time is what counts. A Messages stream is always
	// buffered (vLLM's never carry a handle). A chat or completions stream
	// is buffered once a stream of that API from its decode engine ended
	// without a handle, and never once one carried a handle (vLLM PR
	// #40186); until then one stream per engine and API at a time goes as
	// the client asked, to show it (on stock engines that turn is not
	// retained), and the others are buffered. PathResponses is an error:
	// its streams carry the handle on response.completed. Default nil:
	// none, every stream is passed through as the engine sends it.
	BufferStreams []string

	// Budget is the share of each decode engine's KV capacity that this
	// Router's retained handles may hold: when a retained handle takes an
	// engine's holds over it, the holds worth least are released in the
	// background (value: the prefill time a hit would save × the chance,
	// learned from the pauses between turns, that the conversation comes
	// back before the hold expires, per block). Under it nothing is
	// released but to make room for live work (Headroom): with free
	// memory, holding costs nothing. The default is 0.9: since room is
	// made for each decode leg on arrival, the budget only bounds what
	// holds may take; the fleet benchmark (BENCHMARKS.md, section 10:
	// prefix caching on, decode capacity half of the mean demand) reuses
	// 76% of what an offline bound on any release policy reaches with one
	// router and with four sharing a store and a Ledger, recomputes 1.23x
	// the prompt tokens of unlimited memory, and keeps every engine's usage
	// within the budget with no preemption. It must be at most 1. It applies to
	// an engine whose capacity is known (its /metrics, or Capacity); an
	// engine of unknown capacity is treated as before: every handle held
	// for the retention TTL. KV the engine reports in use beyond this
	// Router's holds and live legs (DecodeKV.Unseen: other routers' holds,
	// streams without a handle, orphans) counts against the budget too.
	//
	// A negative Budget turns the management off: no handle is released,
	// no engine's /metrics is read for it, placement ignores pressure: the
	// router holds every handle for the retention TTL, as routers did
	// before (the fleet benchmark's "hold everything").
	Budget float64
	// Headroom is the share of a decode engine's KV capacity kept free
	// of holds when a decode leg arrives: while the engine's holds and
	// the decode legs in flight on it (each counted as its prompt and
	// its max_tokens) take more than (1 − Headroom) × capacity, the holds
	// worth least are released, in the background, so that the engine
	// admits the leg as soon as their blocks are freed, instead of
	// queueing it behind holds that would lapse only at the TTL; Budget
	// bounds holds and legs together the same way when it is the lower
	// (the default 0.9 is), so that the engine's own usage, live work
	// included, stays within Budget. Holds then yield to live work at any
	// Budget: with free memory they cost nothing, and Budget bounds them.
	// Default 0.05; it must be below 1;
	// negative: no room is made on arrival (holds are released only above
	// Budget).
	Headroom float64
	// RoomRate bounds what the requests of one principal
	// (Request.Principal) may release of other tenants' holds to make
	// room on arrival (Headroom): a share of a decode engine's KV capacity
	// per minute, refilled continuously, at most a minute's worth at once.
	// The holds of the principal's own tenant are released for its
	// requests without limit, so a single tenant's traffic is never held
	// back, while a client asking again and again for more than it uses
	// (a huge max_tokens) cannot drain the others' holds; the room it
	// does not get comes from what D frees by itself. Room on arrival is
	// also bounded by what a request can use on the engine (its prompt
	// and max_tokens, clipped to the engine's max_model_len), made once a
	// turn, and not at all for a request the engine will reject. The
	// router remembers the principals that used it within the last
	// minute, 4096 at most. Default 0.5; negative: no limit.
	RoomRate float64
	// Capacity is the KV capacity, in tokens, of a decode engine whose
	// /metrics do not report one (vllm:cache_config_info: num_gpu_blocks
	// × block_size). Default 0: unknown. Negative is an error. The router
	// reads each decode engine's /metrics at New (in the background); an
	// engine whose capacity stays unknown has the management off, which is
	// logged once per engine with this fix, counted (Stats.CapacityUnknown)
	// and shown (EndpointStatus.NoCapacity).
	Capacity int64
	// HighWatermark is the share of a decode engine's KV memory in use
	// (vllm:kv_cache_usage_perc, holds included, corrected by the holds
	// this router retained or released since the reading) at or above
	// which the engine is crowded (Candidate.Crowded): a conversation's
	// affinity to the engine that holds its KV yields, and LeastLoaded
	// places new turns elsewhere while another engine has room. An
	// engine that preempted requests since the reading before is crowded
	// too. Default 0.9; it must be at most 1; negative: no engine is ever
	// crowded.
	HighWatermark float64
	// MetricsInterval is how old a decode engine's /metrics reading may
	// get before a turn that considers the engine has it read again, in
	// the background (never on the turn's path): its KV capacity, usage,
	// waiting requests and preemptions. A restart it shows
	// (process_start_time_seconds) is told to the restart check
	// (WithHealth's RestartCheck), which still reads before it attaches a
	// handle. Default 5 s; negative: never
	// read (capacity then comes from Capacity alone, and placement sees
	// no pressure).
	MetricsInterval time.Duration
	// Releases bounds the release requests in flight at once: the
	// one-token prefill requests that release holds over the budget.
	// Default 4; negative is an error.
	Releases int
	// Ledger is the ledger the Router keeps its holds and its learned
	// model of the pauses between turns in. Give one to read its Usage
	// and Snapshot (the proxy's /metrics do), or to choose which holds go
	// first (budget.WithValue: a decode-memory release order). A Ledger
	// built without budget.WithFraction or budget.WithCapacity takes
	// Budget and Capacity (their defaults when 0) as if it had been built
	// with them (budget.Budget.Inherit), so budget.New() alone keeps the
	// Router's 0.9, not the package's 0.5; a Ledger built with its own
	// keeps it, and Budget or Capacity set here as well is an error.
	//
	// One Ledger may serve several Routers in one process (replicas
	// sharing a Store, each given the same Ledger): they budget against
	// the same holds, each added once, whichever replica retained it; a
	// turn through any replica that finds its handle ends its hold once
	// (the Store's Take is single-use); a release chooses among every
	// replica's holds on the engine and takes the handle from the Store
	// first, so a hold used through another replica is never released
	// (Stats.ReleaseGone counts a take that finds it gone); room on
	// arrival (Headroom) counts every replica's decode legs in flight
	// (budget.Budget.Running); capacities read by any replica serve all,
	// and the pauses between turns are learned from every replica's turns. The first Router's settings
	// fill in what the Ledger's maker left (above); a later Router whose
	// Budget, Capacity, TTLs or block size differ is an error naming
	// both. A Router's Close stops its own work only: the holds it
	// retained stay counted, and the other replicas use or release them.
	// Replicas in other processes share theirs through a Journal (below).
	// Default nil: a ledger of budget.WithFraction(Budget) and
	// budget.WithCapacity(Capacity), this Router's alone.
	Ledger *budget.Budget
	// Journal shares the ledger with Routers in other processes
	// (budget.WithJournal; retention/redisstore's Store.Journal beside a
	// Redis Store they share): every process's ledger then holds every
	// process's holds, the engines' capacities any of them read, their
	// decode legs in flight and the pauses learned from all their turns,
	// so that each budgets against the same holds and releases any of
	// them (taking the handle from the Store first, as between replicas of
	// one process). The Router's background work syncs the ledger with it
	// every second (budget.Budget.Sync), never on a turn's path: the
	// others' changes are seen up to about two seconds late. A process that
	// stops leaves its holds counted until they are used, released or
	// expire, and its legs in flight counted for budget.JournalLease. A
	// failed sync is counted (the ledger's Stats().Journal) and logged
	// once. With a Ledger given, the Ledger's own budget.WithJournal
	// takes precedence; Routers of one process sharing a Ledger give the
	// same Journal or none. Default nil: the ledger is this process's.
	Journal budget.Journal

	// CPUTierTokens is each decode engine's CPU tier, in tokens, when the
	// engines run vLLM's OffloadingConnector after the NixlConnector
	// (MultiConnector) with offload_prompt_only false and the peer tier
	// (docs/cpu-tier.md): a decode engine then writes every turn's sealed
	// blocks through to CPU memory, where they outlive its GPU hold. A
	// turn with no GPU hold to attach (released by the budget, expired,
	// not attached) has its prefill engine pull, by block hash, what the
	// conversation's last decode engine still holds there
	// (kv_transfer_params.remote_kv_source), when the ledger's estimate of
	// it makes the pull cheaper than recomputing (threshold.PathPeer,
	// TurnRecord.PeerSource): a hold the budget releases is demoted, not
	// dropped. A chunk the tier lost ends the pull there and the prefill
	// engine computes the rest: a wrong estimate costs time, never a
	// wrong token. vLLM exports no tier capacity, so it is given here;
	// the prefill engines need the tier too (pulled chunks land in their
	// own CPU tier first). Needs the management on (Budget not negative).
	// Default 0: no tier.
	CPUTierTokens int
	// CPUTierPort is the decode engines' peer tier port
	// (VLLM_P2P_SIDE_CHANNEL_PORT) on each engine's URL host. Default 5710.
	CPUTierPort int
	// CPUTierPeers maps a decode engine's URL to its peer tier's
	// "host:port" (VLLM_P2P_SIDE_CHANNEL_HOST and port), for engines whose
	// tier is not on their URL's host at CPUTierPort.
	CPUTierPeers map[string]string
	// CPUTierFirst: a turn whose retained GPU hold the decode engine's
	// CPU tier is estimated to hold whole pulls it from the tier instead
	// (the hold is released through the turn's prefill leg, as one the
	// cost model chose not to attach): a pull by block hash needs no
	// verification, so the turn skips the render call token verification
	// makes on its way, and the GPU memory goes back to live work a turn
	// sooner. The pull costs the host-to-device copy of what the prefill
	// engine lacks more than the hold's. Default false.
	CPUTierFirst bool
	// CPUTierPromptOnly: the decode engines keep offload_prompt_only true
	// (vLLM's default), so their tiers hold each turn's prompt, not its
	// answer.
	CPUTierPromptOnly bool
}

// WithDecodeMemory sets what the router does with the decode engines' KV
// memory. A zero field keeps its default; see DecodeMemory for what a
// negative value turns off and what is an error (a BufferStreams path
// without a synthesized stream is one).
func WithDecodeMemory(m DecodeMemory) Option {
	return optionFunc(func(c *config) { c.decodeMemory = m })
}

// TTLs are how long the KV the legs leave behind lives: what the router
// keeps, and what it must know of the engines' own lifetimes.
type TTLs struct {
	// Retention is how long a decode handle is kept, counted from the
	// moment the router saw the decode engine finish: by default 450 s,
	// 30 s under the engines' default decoder_kv_blocks_ttl, as vLLM's
	// reference proxy does. It must leave at least expiryGuard under
	// DecoderBlocks.
	Retention time.Duration
	// DecoderBlocks is the decode engines' decoder_kv_blocks_ttl (vLLM's
	// default, 480 s): Retention is validated against it, and a hold past
	// its retention that is not released is counted (DecodeKV) until it.
	DecoderBlocks time.Duration
	// PrefillLease is the prefill engines' kv_lease_duration (vLLM's
	// default, 30 s): a decode leg is sent with P's handle only while at
	// least expiryGuard of the lease is left; later, the turn is redone as
	// a plain miss. It must be longer than expiryGuard.
	PrefillLease time.Duration
}

// WithTTLs sets the TTLs. A zero field keeps its default (Defaults); a
// negative one is an error.
func WithTTLs(t TTLs) Option {
	return optionFunc(func(c *config) { c.ttls = t })
}

func resolveTTLs(c *config) {
	d, t := Defaults().TTLs, c.ttls
	c.positive("WithTTLs", "Retention", int64(t.Retention))
	c.positive("WithTTLs", "DecoderBlocks", int64(t.DecoderBlocks))
	c.positive("WithTTLs", "PrefillLease", int64(t.PrefillLease))
	c.retentionTTL = orDefault(t.Retention, d.Retention)
	c.decoderTTL = orDefault(t.DecoderBlocks, d.DecoderBlocks)
	c.lease = orDefault(t.PrefillLease, d.PrefillLease)
	if c.retentionTTL > 0 && c.decoderTTL > 0 && c.retentionTTL > c.decoderTTL-expiryGuard {
		c.fail("WithTTLs", "Retention %v leaves less than %v under the engines' decoder_kv_blocks_ttl of %v; use at most %v (or raise DecoderBlocks to match the engines)",
			c.retentionTTL, expiryGuard, c.decoderTTL, c.decoderTTL-expiryGuard)
	}
	if c.lease > 0 && c.lease <= expiryGuard {
		c.fail("WithTTLs", "PrefillLease %v must be longer than %v", c.lease, expiryGuard)
	}
}

// Timeouts bound the legs. They are per phase, never a client-wide
// timeout, which would cut long streams.
type Timeouts struct {
	// Prefill bounds the prefill leg, from sending the request to reading
	// P's whole answer (default 60 s).
	Prefill time.Duration
	// FirstByte bounds the wait for the decode engine's response headers
	// (default 60 s).
	FirstByte time.Duration
	// Idle bounds the gap between two stream reads from the decode engine
	// (default 120 s).
	Idle time.Duration
	// Render bounds one render call (token verification, and the prompt
	// fingerprint of Responses and Messages turns; default 10 s): a call
	// that runs out opens that engine's render breaker, and turns go on
	// without a render.
	Render time.Duration
	// Buffered bounds the wait for the answer of a buffered stream's
	// decode leg (WithDecodeMemory's BufferStreams), which runs
	// non-streaming: the engine sends its headers with the whole answer,
	// so this bounds the whole decode, in place of FirstByte (default 10
	// min, the Anthropic SDKs' own request timeout).
	Buffered time.Duration
}

// WithTimeouts sets the legs' timeouts. A zero field keeps its default
// (Defaults); a negative Prefill, FirstByte, Idle or Buffered means no
// limit; Render must be limited (negative is an error).
func WithTimeouts(t Timeouts) Option {
	return optionFunc(func(c *config) { c.timeouts = t })
}

func resolveTimeouts(c *config) {
	d, t := Defaults().Timeouts, c.timeouts
	c.prefillTimeout = orNone(t.Prefill, d.Prefill)
	c.firstByteTimeout = orNone(t.FirstByte, d.FirstByte)
	c.idleTimeout = orNone(t.Idle, d.Idle)
	c.bufferedTimeout = orNone(t.Buffered, d.Buffered)
	c.positive("WithTimeouts", "Render", int64(t.Render))
	c.renderTimeout = orDefault(t.Render, d.Render)
}

// Failover says what a turn does when a leg fails.
type Failover struct {
	// PrefillRetry is how failed prefill legs are retried (attempts,
	// backoff, the longest Retry-After honoured). Its zero value is
	// transport.RetryPolicy's defaults: 3 attempts, backoff from 50 ms
	// doubling to 1 s, Retry-After honoured up to 5 s. MaxAttempts 1
	// disables retries.
	PrefillRetry transport.RetryPolicy
	// DecodeAttempts bounds how many decode legs one turn may start,
	// retries included (default 3; 1 disables decode retries). After a
	// leg that timed out, at most one more leg follows, to another
	// healthy engine. docs/kvroute.md, Failure paths, says when a decode
	// leg is retried.
	DecodeAttempts int
	// LocalPrefill chooses what happens when the prefill engine answers
	// without a handle. False (the default), the turn fails with 502. True,
	// the decode engine gets the client's request with no
	// kv_transfer_params and prefills locally; the fallback is logged and
	// reported to the Observer. The miss handle is never sent to a decode
	// engine either way.
	LocalPrefill bool
}

// WithFailover sets what a turn does when a leg fails. A zero field keeps
// its default (Defaults); a negative DecodeAttempts is an error.
func WithFailover(f Failover) Option {
	return optionFunc(func(c *config) { c.failover = f })
}

func resolveFailover(c *config) {
	f := c.failover
	c.positive("WithFailover", "DecodeAttempts", int64(f.DecodeAttempts))
	c.retry = f.PrefillRetry
	c.decodeAttempts = orDefault(f.DecodeAttempts, Defaults().Failover.DecodeAttempts)
	c.localFallback = f.LocalPrefill
}

// orDefault is v, or def for a zero v.
func orDefault[T int | int64 | time.Duration](v, def T) T {
	if v == 0 {
		return def
	}
	return v
}

// orNone is a duration that may be unlimited: v, def for a zero v, and 0
// (no limit) for a negative one.
func orNone(v, def time.Duration) time.Duration {
	switch {
	case v < 0:
		return 0
	case v == 0:
		return def
	}
	return v
}
