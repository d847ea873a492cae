package sim

import (
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"net/http"
	"sync"
	"time"
)

// Clock tells the engine the time.
type Clock interface{ Now() time.Time }

// Sleeper is an optional Clock capability: a clock that implements it (such
// as a virtual clock) receives the modelled durations instead of real sleeps.
type Sleeper interface {
	Sleep(ctx context.Context, d time.Duration) error
}

type realClock struct{}

func (realClock) Now() time.Time { return time.Now() }

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

// Config configures an engine. DefaultConfig gives vLLM's defaults.
type Config struct {
	Model               string
	BlockSize           int
	NumBlocks           int
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
	SidePort            int
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
	// DriftRate is the probability per reply (0 to 1, decided from the KV,
	// so Reference reproduces it) that one content word is emitted as two
	// tokens whose text re-tokenizes to one (BPE drift).
	DriftRate float64
	// Template is the chat template family: TemplateChatML (default; ""
	// means the same) or TemplateLlama3.
	Template string
	// ContentFormat is how text parts reach the template:
	// ContentFormatString (default; "" means the same) or
	// ContentFormatOpenAI.
	ContentFormat string
	// DecodeRecompute makes kv_recompute_threshold guard D's pull too, as
	// current vLLM does: D computes locally instead of pulling fewer tokens
	// than the threshold, and still notifies P (off by default so that
	// existing expectations of D's pulls hold).
	DecodeRecompute bool
	// PrefillHandleOnLengthOnly is an older engine's P: it emits its handle
	// only when the request stopped on max_tokens, not on a normal stop
	// (EOS or a stop string) as current vLLM does.
	PrefillHandleOnLengthOnly bool
	// Bidirectional is kv_connector_extra_config.bidirectional_kv_xfer:
	// when false D emits no handle and P ignores D handles.
	Bidirectional bool
	// Render is the render endpoints' mode: RenderEnabled (default; ""
	// means the same), RenderDisabled (501) or RenderAbsent (404).
	Render   string
	Clock    Clock     // nil: real time
	Registry *Registry // nil: a private registry
	Logger   *slog.Logger
}

// DefaultConfig returns the defaults: sim-model, 16-token blocks, 8192
// blocks, prefix caching on, bidirectional, stock streams, threshold 64, TTL 480 s, lease
// 30 s, policy fail, zero-cost profile, speed 0, TP 1.
func DefaultConfig() Config {
	return Config{
		Model:               "sim-model",
		BlockSize:           16,
		NumBlocks:           8192,
		PrefixCaching:       true,
		RecomputeThreshold:  64,
		DecoderBlocksTTL:    480 * time.Second,
		LeaseDuration:       30 * time.Second,
		KVLoadFailurePolicy: PolicyFail,
		TPSize:              1,
		Bidirectional:       true,
		Render:              RenderEnabled,
		Template:            TemplateChatML,
		ContentFormat:       ContentFormatString,
		ReasoningField:      ReasoningFieldReasoning,
	}
}

// ErrInvalidConfig reports a configuration the engine refuses.
var ErrInvalidConfig = errors.New("sim: invalid config")

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
	case c.DriftRate < 0 || c.DriftRate > 1:
		return bad("drift rate %v must be between 0 and 1", c.DriftRate)
	case c.TPSize < 1:
		return bad("tp size %d must be at least 1", c.TPSize)
	case !oneOf(c.Template, TemplateChatML, TemplateLlama3):
		return bad("template %q must be %q or %q", c.Template, TemplateChatML, TemplateLlama3)
	case !oneOf(c.ContentFormat, ContentFormatString, ContentFormatOpenAI):
		return bad("content format %q must be %q or %q", c.ContentFormat, ContentFormatString, ContentFormatOpenAI)
	case !oneOf(c.ReasoningField, ReasoningFieldReasoning, ReasoningFieldContent, ReasoningFieldBoth):
		return bad("reasoning field %q must be %q, %q or %q", c.ReasoningField, ReasoningFieldReasoning, ReasoningFieldContent, ReasoningFieldBoth)
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
	// calls to /tokenize (neither counts in Requests).
	RenderRequests, TokenizeRequests int
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
}

type heldState int

const (
	heldActive heldState = iota
	heldFreed
	heldExpired
)

// held is a handle's blocks kept for a remote reader.
type held struct {
	seq      *seq
	deadline time.Time
	decode   bool // TTL (decode) rather than lease (prefill)
	state    heldState
}

// Engine is one simulated vLLM server. It is an http.Handler and the Peer
// its side channel serves. Safe for concurrent use.
type Engine struct {
	cfg   Config
	clock Clock
	reg   *Registry
	log   *slog.Logger

	mu         sync.Mutex
	id         string
	start      time.Time
	monoOffset float64
	pool       *pool
	held       map[string]*held
	stats      Stats
	records    []*Record
	failN      int
	failStatus int
	cutAfter   int // -1: none armed
	stall      time.Duration
	closed     bool
}

// New starts an engine and registers its side channel.
func New(cfg Config) (*Engine, error) {
	if err := cfg.validate(); err != nil {
		return nil, err
	}
	e := &Engine{cfg: cfg, clock: cfg.Clock, reg: cfg.Registry, log: cfg.Logger, cutAfter: -1}
	if e.clock == nil {
		e.clock = realClock{}
	}
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
	if err := e.reg.Register(e.cfg.SideHost, e.cfg.SidePort, e); err != nil {
		return nil, err
	}
	return e, nil
}

// reset gives the engine a fresh identity and an empty pool; e.mu held or
// not yet shared.
func (e *Engine) reset() {
	e.id = "sim-" + randHex(6)
	e.start = e.clock.Now()
	e.monoOffset = float64(1000 + randUint()%90000)
	e.pool = newPool(e.cfg.NumBlocks, e.cfg.BlockSize, e.cfg.PrefixCaching)
	e.held = map[string]*held{}
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

// Close unregisters the side channel.
func (e *Engine) Close() {
	e.mu.Lock()
	e.closed = true
	e.mu.Unlock()
	e.reg.Unregister(e.cfg.SideHost, e.cfg.SidePort, e)
}

// Config returns the engine's configuration.
func (e *Engine) Config() Config { return e.cfg }

// EngineID returns the current engine id (it changes on Restart).
func (e *Engine) EngineID() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.id
}

// SideChannel returns the side-channel address put in handles.
func (e *Engine) SideChannel() (string, int) { return e.cfg.SideHost, e.cfg.SidePort }

// Mono returns the engine's monotonic clock in seconds (arbitrary offset).
func (e *Engine) Mono() float64 {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.mono(e.clock.Now())
}

func (e *Engine) mono(now time.Time) float64 {
	return e.monoOffset + now.Sub(e.start).Seconds()
}

// Stats returns a snapshot of the counters, after freeing whatever expired.
func (e *Engine) Stats() Stats {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.sweep(e.clock.Now())
	s := e.stats
	s.FreeBlocks = e.pool.freeCount()
	s.BlocksPinned = 0
	for _, h := range e.held {
		if h.state == heldActive {
			s.BlocksPinned += len(h.seq.blocks)
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

// Restart loses every block and handle and takes a new engine id; the
// addresses stay.
func (e *Engine) Restart() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.reset()
	e.stats.Restarts++
}

func (e *Engine) groups() int { return max(e.cfg.KVGroups, 1) }

// sweep frees held blocks whose lease or TTL ran out; e.mu held.
func (e *Engine) sweep(now time.Time) {
	for _, h := range e.held {
		if h.state == heldActive && !now.Before(h.deadline) {
			h.seq.release()
			h.state = heldExpired
			if h.decode {
				e.stats.TTLExpiries++
			} else {
				e.stats.LeaseExpiries++
			}
		}
	}
}

// Meta implements Peer.
func (e *Engine) Meta(context.Context) (string, float64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return "", 0, ErrUnreachable
	}
	return e.id, e.mono(e.clock.Now()), nil
}

// Read implements Peer: a raw positional read of blocks, counted as a read
// of freed or expired blocks when the handle is no longer held.
func (e *Engine) Read(_ context.Context, engineID, requestID string, blocks []int, tokens int) ([][]uint64, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, ErrUnreachable
	}
	if engineID != e.id {
		return nil, ErrEngineID
	}
	e.sweep(e.clock.Now())
	data, err := e.pool.readBlocks(blocks, e.groups())
	if err != nil {
		return nil, err
	}
	switch h, ok := e.held[requestID]; {
	case !ok || h.state == heldFreed:
		e.stats.FreedReads++
	case h.state == heldExpired:
		e.stats.ExpiredReads++
	}
	e.stats.TokensPulledOut += tokens
	return data, nil
}

// Notify implements Peer: the handle was consumed, free its blocks.
func (e *Engine) Notify(_ context.Context, engineID, requestID string) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return ErrUnreachable
	}
	if engineID != e.id {
		return ErrEngineID
	}
	e.sweep(e.clock.Now())
	if h, ok := e.held[requestID]; ok && h.state == heldActive {
		h.seq.release()
		h.state = heldFreed
	}
	return nil
}

var _ Peer = (*Engine)(nil)
