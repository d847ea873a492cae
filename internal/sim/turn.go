package sim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
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
func (c *Config) GenParams(r *Request, sample int) GenParams {
	return GenParams{MaxTokens: r.MaxTokens, MinTokens: r.MinTokens, IgnoreEOS: r.IgnoreEOS, Stop: r.Stop,
		Reasoning: c.Reasoning && r.Thinking, Sample: sample, EOS: c.eos(), Trailing: c.template() == TemplateLlama3,
		DriftRate: c.DriftRate}
}

func (e *Engine) genParams(r *Request, sample int) GenParams { return e.cfg.GenParams(r, sample) }

// execute prefills (reading from a remote when the handle says so) and
// generates. On success t.seq holds the request's blocks.
func (e *Engine) execute(ctx context.Context, t *turn) *apiError {
	n := len(t.toks)
	bs := e.cfg.BlockSize

	e.mu.Lock()
	e.sweep(e.clock.Now())
	t.pool = e.ranks[t.rank].pool
	t.seq = &seq{pool: t.pool, blocks: t.pool.match(t.toks)}
	t.hit = len(t.seq.blocks) * bs
	if t.hit > 0 && e.poisoned(t) {
		t.rec.Poisoned = true
		e.stats.PoisonedHits++
	}
	err := t.seq.grow(n)
	e.mu.Unlock()
	if err != nil {
		e.releaseSeq(t)
		return &apiError{status: http.StatusServiceUnavailable, msg: err.Error()}
	}

	data, first, failed := e.pull(ctx, t)
	if errors.Is(failed, errAssert) {
		// A dead worker: the request fails and the engine restarts with
		// nothing held (a new engine id, as a restarted process has).
		e.log.Error("worker assert", "err", failed)
		e.mu.Lock()
		e.stats.AssertFailures++
		e.reset()
		e.stats.Restarts++
		e.mu.Unlock()
		t.rec.Pull = PullFailed
		e.releaseSeq(t)
		return &apiError{status: http.StatusInternalServerError, msg: engineDead}
	}
	if failed != nil {
		e.mu.Lock()
		e.stats.LoadFailures++
		if errors.Is(failed, errDeclined) {
			e.stats.DeclinedReads++
		}
		e.mu.Unlock()
		t.rec.Pull = PullFailed
		if e.cfg.KVLoadFailurePolicy == PolicyFail {
			e.releaseSeq(t)
			return internalError()
		}
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
	computed := n - start

	t.gens = make([]Generated, t.req.N)
	for i := range t.gens {
		t.gens[i] = Generate(prev, n, e.genParams(t.req, i))
	}
	g := t.gens[0]
	if k := len(g.Tokens) - 1; k > 0 {
		if err := t.seq.grow(n + k); err != nil {
			t.seq.release()
			return &apiError{status: http.StatusServiceUnavailable, msg: err.Error()}
		}
		full := append(append([]uint32(nil), t.toks...), ids(g.Tokens[:k])...)
		for j := 0; j < k; j++ {
			s := t.seq.at(n + j)
			s.kv, s.tok = g.KV[j], full[n+j]
		}
		t.pool.commit(t.seq.blocks, full)
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
	r.Transfer = p.Transfer(t.count)
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

// pull applies the handle: decides the count, reads positionally through the
// side channel and notifies the emitter. It returns the data for local blocks
// first, first+1, ... or the load failure.
func (e *Engine) pull(ctx context.Context, t *turn) (data [][]uint64, first int, failed error) {
	p := t.params
	if t.role == RolePlain || p == nil || !p.Usable() || (t.role == RolePrefill && !e.cfg.Bidirectional) {
		t.rec.Pull = PullNone
		return nil, 0, nil
	}
	n := len(t.toks)
	rnt := p.NumTokens
	if rnt < 0 {
		rnt = n
	}
	count := min(rnt, n) - t.hit
	switch {
	case count <= 0:
		t.rec.Pull = PullNone
	case (t.role == RolePrefill || e.cfg.DecodeRecompute) && e.cfg.RecomputeThreshold > 0 && count < e.cfg.RecomputeThreshold:
		// kv_recompute_threshold guards P's pull, and D's with
		// DecodeRecompute; either way the reader still notifies
		t.rec.Pull = PullRecompute
		e.mu.Lock()
		e.stats.Recomputed++
		e.mu.Unlock()
	default:
		t.rec.Pull = PullRead
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
			if len(ids) < numLocal {
				return nil, 0, fmt.Errorf("%w: group %d: len(local) %d > len(remote) %d", errAssert, g, numLocal, len(ids))
			}
		}
	}
	// Whether it reads or not, the reader notifies: the handle is consumed.
	defer func() { _ = peer.Notify(ctx, p.EngineID, p.RequestID) }()
	if t.rec.Pull != PullRead {
		return nil, 0, nil
	}
	if t.role == RolePrefill && p.Expiry != nil && mono >= *p.Expiry-5 {
		return nil, 0, errDeclined
	}
	for g, ids := range p.Groups {
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

func (e *Engine) releaseSeq(t *turn) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if t.seq != nil {
		t.seq.release()
	}
}

// hold keeps the request's blocks for a remote reader and returns the handle,
// or releases them and returns nil when no handle is due: P and D emit one
// on a normal finish (length or stop); with PrefillHandleOnLengthOnly P
// only when it stopped on max_tokens (older engines' FINISHED_LENGTH_CAPPED).
func (e *Engine) hold(t *turn) json.RawMessage {
	e.mu.Lock()
	defer e.mu.Unlock()
	g := t.gens[0]
	prefillDue := g.Finish == "length" || (g.Finish == "stop" && !e.cfg.PrefillHandleOnLengthOnly)
	due := (t.role == RolePrefill && prefillDue) || (t.role == RoleDecode && e.cfg.Bidirectional)
	r := e.ranks[t.rank]
	if !due || t.pool != r.pool {
		t.seq.release()
		return nil
	}
	now := e.clock.Now()
	groups := make([][]int, e.groups())
	for g := range groups {
		groups[g] = t.seq.ids()
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
	hd := &held{seq: t.seq, decode: t.role == RoleDecode}
	if hd.decode {
		h.DoRemoteDecode = true
		hd.deadline = now.Add(e.cfg.DecoderBlocksTTL)
		exp := e.mono(hd.deadline)
		h.RemoteBlocksExpiryTime = &exp
	} else {
		h.DoRemotePrefill = true
		hd.deadline = now.Add(e.cfg.LeaseDuration)
	}
	r.held[t.rec.EngineRequestID] = hd
	e.stats.HandlesEmitted++
	raw, _ := json.Marshal(h)
	t.rec.Handle = raw
	return raw
}

// abort frees what the request holds (blocks kept for a handle included):
// an aborted request emits no handle and frees at once.
func (e *Engine) abort(t *turn) {
	e.mu.Lock()
	defer e.mu.Unlock()
	held := e.ranks[t.rank].held
	if h, ok := held[t.rec.EngineRequestID]; ok && h.state == heldActive {
		delete(held, t.rec.EngineRequestID)
		e.stats.HandlesEmitted--
	}
	t.seq.release()
	t.rec.Aborted = true
	t.rec.Handle = nil
	e.stats.Aborted++
}
