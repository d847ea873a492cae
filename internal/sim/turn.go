package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"time"
)

// Pull decisions recorded in Record.Pull.
const (
	PullNone      = "none"      // nothing to read (count <= 0) or no usable handle
	PullRead      = "pull"      // read count tokens from the remote
	PullRecompute = "recompute" // count below kv_recompute_threshold: computed locally
	PullFailed    = "failed"    // the read failed (declined, unreachable, wrong engine)
)

// turn is one completion request going through the engine.
type turn struct {
	rec    *Record
	req    *Request
	params *Params
	role   string
	rank   int // the data-parallel rank serving it
	toks   []uint32
	seq    *seq
	pool   *pool
	hit    int
	count  int // tokens transferred
	gens   []Generated

	// The scheduler's view (sched.go; e.mu).
	rk        *rank // the rank it was queued on (a restart replaces e.ranks)
	n         int   // prompt tokens
	state     turnState
	wake      chan struct{}
	parked    bool   // counted by a Parker clock
	resume    func() // the Parker's resume, once woken
	gen       int    // invalidates the timer of an earlier wait
	stopWork  func() bool
	heartbeat func() bool // stops the heartbeat to P while it waits
	arrived   time.Time
	waitFrom  time.Time // when it was last preempted
	recompute bool      // preempted: recompute what it had once let in again
	pulling   bool      // admitted to read from a remote: takes no running slot
	started   bool      // admitted once: allToks and allKV are known
	done      int       // decode steps passed (generated tokens of choice 0)
	allToks   []uint32  // prompt and choice 0's generated tokens
	allKV     []uint64  // the KV of allToks but its last token
	phase     int
	phaseAt   time.Time
	chunk     int // decode steps of the current wait

	// The CPU tier (cpuload.go): the request's offloading keys, the
	// chunks prefetched from a peer (by chunk index), what it loaded at
	// admission and the chunks it has written through.
	offload      *offloadParams
	peerAsked    bool
	peerMissed   bool // the load consulted the peer for a chunk and it had none
	peerKV       map[int][]uint64
	tierPins     []*cpuChunk
	tierTokens   int
	peerTokens   int
	storedChunks int
}

// apiError is an error answered in vLLM's shape.
type apiError struct {
	status int
	msg    string
}

func (e *apiError) Error() string { return e.msg }

func internalError() *apiError {
	return &apiError{status: http.StatusInternalServerError, msg: "Internal server error"}
}

// roleOf decides the role from kv_transfer_params, as the NixlConnector does:
// do_remote_prefill first (read, then decode), then do_remote_decode (prefill
// and hold for a remote decoder).
func roleOf(p *Params) string {
	switch {
	case p == nil:
		return RolePlain
	case p.DoRemotePrefill:
		return RoleDecode
	case p.DoRemoteDecode:
		return RolePrefill
	default:
		return RolePlain
	}
}

// GenParams returns the generation parameters an engine with configuration
// c uses for choice sample of req.
// Generation stops at max_model_len (MaxModelLen, else NumBlocks ×
// BlockSize) with finish "length", as vLLM's check_stop does.
func (c *Config) GenParams(r *Request, sample int) GenParams {
	maxTokens := r.MaxTokens
	if room := c.maxModelLen() - len(r.Prompt); room < maxIgnoreEOS && (maxTokens == 0 || maxTokens > room) {
		maxTokens = max(room, 1)
	}
	return GenParams{MaxTokens: maxTokens, MinTokens: r.MinTokens, IgnoreEOS: r.IgnoreEOS, Stop: r.Stop,
		Reasoning: c.Reasoning && r.Thinking, Sample: sample, EOS: c.eos(), Trailing: c.template() == TemplateLlama3,
		DriftRate: c.DriftRate, Tools: r.Tools, ToolChoice: r.ToolChoice, ToolCallRate: c.ToolCallRate}
}

func (e *Engine) genParams(r *Request, sample int) GenParams { return e.cfg.GenParams(r, sample) }

// execute prefills an admitted request (reading from a remote when the
// handle says so) and generates, deciding its whole output from the KV it
// holds; the scheduler then passes its modelled time. On an error its
// blocks are released.
func (e *Engine) execute(ctx context.Context, t *turn) *apiError {
	n := len(t.toks)
	bs := e.cfg.BlockSize

	e.mu.Lock()
	if t.hit > 0 && e.poisoned(t) {
		t.rec.Poisoned = true
		e.stats.PoisonedHits++
	}
	e.mu.Unlock()

	data, first, failed := e.pull(ctx, t)
	if errors.Is(failed, errAssert) {
		// A dead worker: the request fails and the engine restarts with
		// nothing held (a new engine id, as a restarted process has).
		e.log.Error("worker assert", "err", failed)
		e.mu.Lock()
		e.stats.AssertFailures++
		t.rec.Pull = PullFailed
		e.finishTurn(t, false)
		e.reset()
		e.stats.Restarts++
		e.mu.Unlock()
		return &apiError{status: http.StatusInternalServerError, msg: engineDead}
	}
	if failed != nil {
		e.mu.Lock()
		e.stats.LoadFailures++
		if errors.Is(failed, errDeclined) {
			e.stats.DeclinedReads++
		}
		t.rec.Pull = PullFailed
		if e.cfg.KVLoadFailurePolicy == PolicyFail {
			e.finishTurn(t, false)
			e.mu.Unlock()
			return internalError()
		}
		e.mu.Unlock()
		data, t.count = nil, 0
	}

	e.mu.Lock()
	defer e.mu.Unlock()
	start := t.hit
	if data != nil {
		for j, kvs := range data {
			b := t.seq.blocks[first+j]
			for s := range b.slots {
				pos := (first+j)*bs + s
				b.slots[s].kv = kvs[s]
				if pos < n {
					b.slots[s].tok = t.toks[pos]
				}
			}
		}
		start = min(t.hit+t.count, n-1)
	} else if t.tierTokens > 0 {
		// loaded from the CPU tier at admission (tierLoad)
		start = min(t.hit+t.tierTokens, n-1)
	}
	prev := Seed(e.cfg.Model)
	if start > 0 {
		prev = t.seq.at(start - 1).kv
	}
	for pos := start; pos < n; pos++ {
		prev = mix(prev, t.toks[pos], pos)
		s := t.seq.at(pos)
		s.kv, s.tok = prev, t.toks[pos]
	}
	t.pool.commit(t.seq.blocks, t.toks)
	e.offload(t, t.toks, n)
	computed := n - start

	t.gens = make([]Generated, t.req.N)
	for i := range t.gens {
		t.gens[i] = Generate(prev, n, e.genParams(t.req, i))
	}
	g := t.gens[0]
	// What the request's blocks will hold as it decodes, and hold again
	// when it is recomputed after a preemption.
	t.n, t.started = n, true
	t.allToks = append(append(make([]uint32, 0, n+len(g.Tokens)), t.toks...), ids(g.Tokens)...)
	t.allKV = make([]uint64, n, n+len(g.Tokens))
	for pos := range n {
		t.allKV[pos] = t.seq.at(pos).kv
	}
	if len(g.KV) > 1 {
		t.allKV = append(t.allKV, g.KV[:len(g.KV)-1]...)
	}

	completion := 0
	for _, g := range t.gens {
		completion += len(g.Tokens)
	}
	r := t.rec
	r.CachedTokens, r.ComputedTokens, r.PulledTokens, r.CompletionTokens = t.hit, computed, t.count, completion
	r.Finish = g.Finish
	p := e.cfg.Profile
	r.Prefill = p.Prefill(computed, start)
	if t.role == RolePlain {
		r.Prefill = p.LocalPrefill(computed, start)
	}
	r.TierTokens, r.PeerTokens = t.tierTokens, t.peerTokens
	r.Transfer = p.Transfer(t.count) + p.PeerPull(t.peerTokens) + p.HostToDevice(t.tierTokens)
	if t.peerMissed && t.peerTokens == 0 {
		r.Transfer += p.PeerLookup // the lookup went to the peer and found nothing
	}
	r.Decode = p.Decode(len(g.Tokens))
	e.stats.TokensComputed += computed
	e.stats.TokensPulledIn += t.count
	e.stats.PrefixHitTokens += t.hit
	if t.role != RolePrefill {
		ref := Reference(e.cfg.Model, t.toks, e.genParams(t.req, 0))
		if !sameTokens(ref.Tokens, g.Tokens) {
			r.Wrong = true
			e.stats.WrongOutputs++
		}
	}
	return nil
}

// poisoned reports whether the prefix-cache hit of t holds KV other than
// the correct chain for its tokens (a bad read cached under this engine's
// token hashes); e.mu held.
func (e *Engine) poisoned(t *turn) bool {
	want := chain(Seed(e.cfg.Model), t.toks[:t.hit], 0)
	for pos, kv := range want {
		if t.seq.at(pos).kv != kv {
			return true
		}
	}
	return false
}

var errDeclined = errors.New("sim: read declined, blocks about to expire")

// pullPlan decides what t's handle makes it read, as the pull connector's
// get_num_new_matched_tokens does once the local prefix-cache hit is known:
// the count of tokens and PullRead, PullRecompute (a count below
// kv_recompute_threshold: computed locally, the emitter still notified) or
// PullNone (nothing to read: notified only). A handle the engine does not
// use at all (a plain request, an unusable handle, a D handle on an engine
// without bidirectional transfer) gives "".
//
// A decode request (do_remote_prefill) reads its whole prompt less the
// local hit: remote_num_tokens is not read. A prefill request
// (do_remote_decode) reads min(remote_num_tokens, prompt) less the local
// hit, a missing remote_num_tokens counting as 0 (params.get(
// "remote_num_tokens") or 0): such a handle reads nothing and only
// releases the emitter's hold.
func (e *Engine) pullPlan(t *turn) (count int, plan string) {
	p := t.params
	if t.role == RolePlain || p == nil || !p.Usable() || (t.role == RolePrefill && !e.cfg.Bidirectional) {
		return 0, ""
	}
	n := len(t.toks)
	if t.role == RoleDecode {
		count = n - t.hit
	} else {
		count = min(max(p.NumTokens, 0), n) - t.hit
	}
	switch {
	case count <= 0:
		return count, PullNone
	case (t.role == RolePrefill || e.cfg.DecodeRecompute) && e.cfg.RecomputeThreshold > 0 && count < e.cfg.RecomputeThreshold:
		// kv_recompute_threshold guards P's pull, and D's with
		// DecodeRecompute (_should_recompute_remote_kv)
		return count, PullRecompute
	}
	return count, PullRead
}

// pull applies the handle: decides the count, reads positionally through the
// side channel and notifies the emitter. It returns the data for local blocks
// first, first+1, ... or the load failure.
func (e *Engine) pull(ctx context.Context, t *turn) (data [][]uint64, first int, failed error) {
	p := t.params
	count, plan := e.pullPlan(t)
	used := plan != ""
	e.mu.Lock()
	if !used {
		plan = PullNone
	}
	if plan == PullRecompute {
		e.stats.Recomputed++
	}
	t.rec.Pull = plan
	e.mu.Unlock()
	if !used {
		return nil, 0, nil
	}
	peer := e.reg.Lookup(p.Host, p.Port)
	if peer == nil {
		return nil, 0, ErrUnreachable
	}
	id, mono, err := peer.Meta(ctx)
	if err != nil {
		return nil, 0, err
	}
	if id != p.EngineID {
		return nil, 0, ErrEngineID
	}
	bs := e.cfg.BlockSize
	first = t.hit / bs
	numLocal := 0
	if t.rec.Pull == PullRead {
		numLocal = (t.hit+count-1)/bs - first + 1
		// The worker asserts len(local) <= len(remote) per group; a
		// failed assert kills it before it reads or notifies.
		if len(p.Groups) != e.groups() {
			return nil, 0, fmt.Errorf("%w: %d KV groups in the handle, %d local", errAssert, len(p.Groups), e.groups())
		}
		for g, ids := range p.Groups {
			need := numLocal
			if g > 0 && e.cfg.hybrid() {
				need = e.cfg.hybridLocal(g, t.hit, count) // hybrid.go
			}
			if len(ids) < need {
				return nil, 0, fmt.Errorf("%w: group %d: len(local) %d > len(remote) %d", errAssert, g, need, len(ids))
			}
		}
	}
	if t.rec.Pull != PullRead {
		// The notify-only path (update_state_after_alloc with no external
		// tokens; the worker's _read_blocks sends the notification alone,
		// without looking at the expiry): the emitter frees the whole hold.
		_ = peer.Notify(ctx, p.EngineID, p.RequestID)
		return nil, 0, nil
	}
	if t.role == RolePrefill && p.Expiry != nil && mono >= *p.Expiry-5 {
		// _is_turn2_read_expired: declined, _handle_failed_transfer, no
		// notification; the emitter holds to its TTL.
		return nil, 0, errDeclined
	}
	for g, ids := range p.Groups {
		if g > 0 && e.cfg.hybrid() {
			if err := e.readHybrid(ctx, peer, p, g, t.hit, count, first, data); err != nil {
				return nil, 0, err
			}
			continue
		}
		// positional: the last numLocal blocks, as vLLM trims
		gd, err := peer.Read(ctx, p.EngineID, p.RequestID, ids[len(ids)-numLocal:], count*b2i(g == 0))
		if err != nil {
			return nil, 0, err
		}
		if g == 0 {
			data = gd
			continue
		}
		// The groups hold parts of one KV: where a group's blocks differ
		// from group 0's, the combined KV is wrong.
		for j := range data {
			for s := range data[j] {
				if j < len(gd) && s < len(gd[j]) && gd[j][s] != data[j][s] {
					data[j][s] = splitmix(data[j][s] ^ gd[j][s] ^ 0xbad)
				}
			}
		}
	}
	// The notification rides on the READ transfer: sent when the read
	// completed, never for a failed one.
	_ = peer.Notify(ctx, p.EngineID, p.RequestID)
	t.count = count
	return data, first, nil
}

func b2i(b bool) int {
	if b {
		return 1
	}
	return 0
}

// errAssert is a worker assert: the engine dies.
var errAssert = errors.New("sim: worker assert failed")

// engineDead is vLLM's EngineDeadError message.
const engineDead = "EngineCore encountered an issue. See stack trace (above) for the root cause."

// complete ends a request that generated its last token: it keeps the
// request's blocks for a remote reader and returns the handle, or releases
// them and returns nil when no handle is due: P and D emit one on a normal
// finish (length or stop); with PrefillHandleOnLengthOnly P only when it
// stopped on max_tokens (older engines' FINISHED_LENGTH_CAPPED). The hold's
// lease or TTL starts now. e.mu held.
func (e *Engine) complete(t *turn) json.RawMessage {
	e.commitDone(t)
	g := t.gens[0]
	prefillDue := g.Finish == "length" || (g.Finish == "stop" && !e.cfg.PrefillHandleOnLengthOnly)
	due := (t.role == RolePrefill && prefillDue) || (t.role == RoleDecode && e.cfg.Bidirectional)
	r := e.ranks[t.rank]
	if !due || t.pool != r.pool {
		e.finishTurn(t, false)
		return nil
	}
	now := e.clock.Now()
	groups := make([][]int, e.groups())
	for g := range groups {
		groups[g] = t.seq.ids()
		if g > 0 && e.cfg.hybrid() {
			groups[g] = e.hybridGroup(t.pool, groups[g], g) // hybrid.go
			continue
		}
		for i := range groups[g] {
			groups[g][i] = t.pool.groupID(groups[g][i], g)
		}
	}
	h := handle{
		RemoteBlockIDs:  groups,
		RemoteEngineID:  r.id,
		RemoteRequestID: t.rec.EngineRequestID,
		RemoteHost:      e.cfg.SideHost,
		RemotePort:      e.cfg.SidePort + t.rank,
		TPSize:          e.cfg.TPSize,
		RemoteNumTokens: len(t.toks) + len(g.Tokens) - 1,
		DCPSize:         1,
		PPSize:          1,
		TransferMode:    "pull",
	}
	r.holds++
	hd := &held{id: t.rec.EngineRequestID, seq: t.seq, decode: t.role == RoleDecode, order: r.holds}
	if hd.decode {
		h.DoRemoteDecode = true
		hd.deadline = now.Add(e.cfg.DecoderBlocksTTL)
		exp := e.mono(hd.deadline)
		h.RemoteBlocksExpiryTime = &exp
	} else {
		h.DoRemotePrefill = true
		hd.deadline = now.Add(e.cfg.LeaseDuration)
	}
	r.held[hd.id], r.active[hd.id] = hd, hd
	e.stats.HandlesEmitted++
	e.stats.Holds++
	raw, _ := json.Marshal(h)
	t.rec.Handle = raw
	// the hold is known before the scheduler looks: a request that waits
	// is let in at its expiry
	e.finishTurn(t, true)
	return raw
}

// abort frees what the request holds (blocks kept for a handle included):
// an aborted request emits no handle and frees at once.
func (e *Engine) abort(t *turn) {
	e.mu.Lock()
	defer e.mu.Unlock()
	r := e.ranks[t.rank]
	if h, ok := r.held[t.rec.EngineRequestID]; ok && h.state == heldActive {
		delete(r.held, h.id)
		delete(r.active, h.id)
		e.stats.HandlesEmitted--
		e.stats.Holds--
	}
	if t.state == stateDone {
		if t.seq != nil {
			t.seq.release()
		}
		e.schedule(t.rk)
	} else {
		e.finishTurn(t, false)
	}
	t.rec.Aborted = true
	t.rec.Handle = nil
	e.stats.Aborted++
}
