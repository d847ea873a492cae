package kvroute

import (
	"context"
	"log/slog"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/kvroute/internal/peertier"
	"github.com/bidikv/bidikv/retention/budget"
	"github.com/bidikv/bidikv/threshold"
)

// found is what the lookup phase found for a request: the Identifier's
// candidates (for Verify and Key), the prefill engines its conversation
// avoids, and the retained handle taken under one of its keys (key "" for
// none).
type found struct {
	cands Candidates
	avoid []string // prefill engines whose prefix cache may hold a mismatched pull (internal/distrust)
	key   string
	e     entry.Entry
	age   time.Duration
	// turn is the conversation's turn number this request is: one more
	// than the handle's found (attached or not), 1 when none was.
	turn int
	// expired: the handle taken (f.e; key "") was past the retention
	// TTL: never attached, perhaps still held by its decode engine
	// (lookup.go).
	expired bool
	// placed is the ledger's record of the conversation's last retained
	// turn (DecodeMemory's CPUTierTokens: peerPath), and resident what
	// its decode engine's CPU tier is estimated to hold of it; placedKey
	// the key the record is under.
	placed    budget.Placement
	resident  int
	placedKey string
}

// lookup takes the retained handle the request continues, if any: the
// first one the Store holds under the Identifier's keys. A handle that
// cannot be attached whatever its verification says (expired, its decode
// engine gone or restarted) is not returned: a gone engine's is put back
// for its remaining retention time, a restarted one's dropped. Misses are
// recorded in the turn's record.
func lookup(ctx context.Context, t *turn) found {
	r := t.r
	f := found{turn: 1}
	if !r.cfg.reuse {
		t.rec.Reuse = ReuseOff
		return f
	}
	cands, err := r.ident.Lookup(t.req)
	f.cands = cands
	if err != nil {
		r.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: identifier lookup failed", slog.String("request_id", t.id), slog.String("err", err.Error()))
		t.miss(MissNoKey)
		return f
	}
	if f.avoid = r.poison.Avoid(cands.Keys, r.cfg.clock()); len(f.avoid) > 0 {
		r.stats.avoidedEngineTurns.Add(1)
	}
	for _, k := range cands.Keys {
		v, ok, err := r.handles.take(ctx, k, t.id)
		if err != nil {
			t.miss(MissStoreError)
			return f
		}
		if !ok {
			continue
		}
		if reason := take(ctx, t, &f, k, v); reason != "" {
			t.miss(reason)
			f.key, f.expired = "", reason == MissExpired
		}
		return f
	}
	// Nothing this request could continue (a first turn, however the
	// Identifier keys turns), or nothing retained under its keys.
	t.miss(MissNotFound)
	return f
}

// take decodes the value v taken under key into f and returns why it
// cannot be attached, "" when verification may decide.
func take(ctx context.Context, t *turn, f *found, key string, v []byte) MissReason {
	r := t.r
	e, err := entry.Decode(v, &r.bufs.bytes)
	if err != nil {
		return MissBadEntry
	}
	if e.Expanded {
		// Put back when the turn ends: every use of the expanded handle
		// (the prefill body's kv_transfer_params, a cut) is a copy made
		// before Do returns.
		t.bufs.expanded = e.Handle
	}
	f.key, f.e, f.age = key, e, r.cfg.clock().Sub(e.Created)
	f.turn = max(e.Turn, 1) + 1 // an entry before version 4: at least the second turn
	if f.age >= r.cfg.retentionTTL {
		return MissExpired
	}
	t.rec.HandleTokens = e.Tokens
	if e.Endpoint != "" && r.decode.find(e.Endpoint) == nil {
		// The decode engine that holds the blocks is gone: P's pull would
		// fail. Not attached; kept for another router that may still list
		// the engine, or for its return.
		r.stats.goneHandles.Add(1)
		f.putBack(ctx, t)
		return MissEndpointGone
	}
	if reason := r.restarts.check(ctx, &f.e); reason != "" {
		if reason == MissRestarted {
			// Its blocks are gone: never attached, not kept, and not
			// released either (pointless).
			r.stats.restartedHandles.Add(1)
			if r.mem.managed(f.e.Endpoint) {
				r.stats.releaseSkipped.Add(1)
			}
		} else {
			f.putBack(ctx, t)
		}
		return reason
	}
	return ""
}

// putBack returns the taken, unused handle to the Store for the rest of
// its retention time: a request never destroys a handle it does not use.
func (f *found) putBack(ctx context.Context, t *turn) {
	t.r.handles.putBack(ctx, f.key, t.req.tenant, &f.e, f.age, t.id)
}

// Decode-local turns (WithDecodeMemory's Local).
//
// A turn whose retained handle was verified by tokens may skip the prefill
// engine: sent as a plain request (no kv_transfer_params at all) to the
// decode engine that holds the conversation, it computes only the new
// suffix from that engine's prefix cache, which the retained blocks keep
// warm. Such a turn retains no new handle and does not consume the old
// one: the handle is put back, so it stays the candidate for the next long
// turn and is verified as usual. No other shape is sent to a decode engine
// without P's handle: do_remote_prefill true with no blocks kills current
// engines' cores, and do_remote_prefill false leaks the blocks of the
// handle it returns. The threshold.Chooser decides per turn.

// ReuseLocal is TurnRecord.Reuse (and X-Bidikv-Reuse) of a decode-local
// turn: the decode engine holding the conversation answered it from its own
// prefix cache; the retained handle was put back, not used.
const ReuseLocal ReuseOutcome = "local"

// MissCostModel: the Chooser estimated recomputing the prompt faster than
// pulling the retained KV; the handle was put back.
const MissCostModel MissReason = "cost_model"

// RefuseDecodeLocal is TurnRecord.StoreRefusal of a decode-local turn: a
// plain request returns no handle, and the conversation's earlier handle
// stays retained.
const RefuseDecodeLocal Refusal = "decode_local"

// way is the path phase's result: the handle the prefill leg carries
// (none for decode-local and recompute turns), or the decode engine a
// decode-local turn goes to; why no handle is attached, what the prompt
// counts in tokens and the Chooser's decision, handed on from verify; and,
// from the release phase (lookup.go), the handle the first prefill
// attempt carries to release a hold the turn does not attach.
type way struct {
	h      hit
	local  *endpoint
	miss   MissReason // why h attaches none ("" when it attaches one, or for a decode-local turn)
	prompt int        // the prompt's tokens as verification counted them, 0 when unknown
	chose  chosen
	rel    []byte
	relWhy releaseReason
	peer   peerPull // the CPU tier the prefill leg pulls from (peerPath); zero: none
}

// peerPull is a turn's pull from a decode engine's CPU tier: the engine,
// its peer tier's address, and what the ledger estimates it holds.
type peerPull struct {
	decode   string
	host     string
	port     int
	resident int
}

// chosen is the Chooser's decision for a turn (asked: it was asked) and
// what it was asked of the prompt: what the learning Chooser observes when
// the turn ends (do.go, observe).
type chosen struct {
	threshold.Choice
	asked           bool
	prompt, matched int // the prompt's tokens, and those the handle's match
	tier            int // a decode-local turn chosen on the tier's estimate (tierChoice): the tokens its engine should reload
}

// choosePath asks the Chooser (WithDecodeMemory's Local), for a handle verified by
// tokens, whether to attach it (PathPull), answer on its decode engine
// (PathLocal) or recompute (PathRecompute). What becomes of a handle
// not attached is the release phase's: a decode-local turn's goes back
// under its key (it stays the candidate).
func choosePath(t *turn, f *found, h hit) way {
	r := t.r
	w := way{h: h, miss: h.miss, prompt: h.v.prompt}
	if r.chooser == nil || h.handle == nil || h.v.prompt <= 0 || h.v.matched <= 0 {
		return w
	}
	ep := r.decode.eligible(f.e.Endpoint)
	if ep == nil {
		return w // the engine holding the blocks is gone or ejected: pull elsewhere
	}
	in := threshold.Turn{PromptTokens: h.v.prompt, ReusableTokens: h.v.matched,
		Decode: ep.url, DecodeInFlight: int(ep.inflight.Load()), HandleAge: f.age, RetentionTTL: r.cfg.retentionTTL}
	c := r.chooser.Choose(in)
	w.chose = chosen{Choice: c, asked: true, prompt: h.v.prompt, matched: h.v.matched}
	t.rec.Choice = c.Path
	t.rec.EstimatedTTFT = c.Estimate
	t.rec.LocalRefusal = c.Refusal
	if c.Refusal == threshold.RefuseLocalBusy {
		r.stats.localBusy.Add(1)
	}
	switch c.Path {
	case threshold.PathLocal:
		r.stats.choseLocal.Add(1) // the release phase puts the handle back: it stays the candidate
		t.rec.Reuse = ReuseLocal
		w.h, w.local = hit{}, ep
		return w
	case threshold.PathRecompute:
		r.stats.choseRecompute.Add(1)
		t.miss(MissCostModel) // the release phase releases the handle or puts it back
		w.h, w.miss = hit{}, MissCostModel
		return w
	}
	r.stats.chosePull.Add(1)
	return w
}

// The release phase. A vLLM decode engine frees a hold early only when a
// prefill request carrying its handle is scheduled: P then tells D to free
// the blocks, whether it pulls them or not. A handle the turn took and
// does not attach is therefore released through the turn's own prefill
// leg, at no extra request: its first attempt carries the handle with
// remote_num_tokens 0 (kvhandle.Release) instead of the miss handle, so
// that P counts nothing to pull, takes the notify-only path and computes
// the prompt as on a miss (its answer is a miss's), while D frees the
// hold at that moment instead of at its TTL.
//
// The rule: the turn releases the handle it took when it replaces it.
// That is when the turn goes through a prefill leg (it will retain D's
// new handle for the conversation: under the same key with a
// conversation id, under a longer one, which the conversation's next
// turn looks up first, by content) and the handle was not attached for
// what it holds, which no later turn of the conversation changes: too
// few verified tokens (MissThreshold; an edited or compacted history), no
// common prefix (MissMismatch), a partial read the handle's blocks do not
// allow (MissPartialRefused), or the cost model's choice to recompute
// (MissCostModel). A handle found past the retention TTL (MissExpired)
// while its decode engine still holds it (the decoder TTL has not run
// out) is released the same way: it can never be attached.
//
// Not released, put back as before: the handle of a decode-local turn
// (it stores no new handle: the old one stays the candidate and stays
// held), one that could not be verified (MissUnverified: it may be
// later), and any whose decode engine is not listed, is ejected, or whose
// capacity is unknown (the management then keeps today's behaviour).
// Handles of a restarted decode engine are dropped, not released
// (pointless: the blocks are gone; Stats.ReleaseSkipped). A retry of the
// prefill leg is a plain miss: the release handle goes to one attempt,
// and a failed one is counted (Stats.ReleaseFailures) and lapses at the
// TTL. The leg's answer never depends on it: P computes its prompt as a
// miss would; a 500 of a failed notification is retried as a plain miss
// and not counted against the engine, as for a hit.

// release decides what becomes of a handle the turn took and does not
// attach (w attaches none): it returns the handle rewritten to release
// the decode engine's hold, which the first prefill attempt carries, and
// why; or it puts the handle back (a decode-local turn's among them: it
// stays the candidate) and returns nil.
func release(ctx context.Context, t *turn, f *found, w way) ([]byte, releaseReason) {
	h, why, back := releaseOf(t, f, w)
	if back {
		f.putBack(ctx, t)
	}
	return h, why
}

// releaseOf is release's decision: the release handle and why, or
// whether the handle goes back to the Store (back).
func releaseOf(t *turn, f *found, w way) (h []byte, why releaseReason, back bool) {
	switch {
	case w.h.handle != nil:
		return nil, 0, false // attached
	case w.local != nil:
		return nil, 0, f.key != "" // decode-local: it stays the candidate
	}
	r := t.r
	switch {
	case f.key != "":
		why = releaseSuperseded
		if !supersedes(w.miss) || !r.mem.managed(f.e.Endpoint) || r.decode.eligible(f.e.Endpoint) == nil {
			return nil, 0, true
		}
	case f.expired:
		// Dropped as before unless it may still be held and releasing it
		// cannot fail the leg for what the router knows of the engine.
		why = releaseUnusable
		if f.age >= r.cfg.decoderTTL || !r.mem.managed(f.e.Endpoint) || r.decode.eligible(f.e.Endpoint) == nil {
			return nil, 0, false
		}
		if r.restarts.restartedSince(&f.e) {
			r.stats.releaseSkipped.Add(1)
			return nil, 0, false
		}
	default:
		return nil, 0, false
	}
	h, err := kvhandle.ReleaseKnown(f.e.Handle, 0, f.e.Blocks) // reads nothing: no block-count check
	if err != nil {
		return nil, 0, f.key != ""
	}
	return h, why, false
}

// supersedes reports whether a handle not attached for reason is dead
// once the turn retains its own (the release rule above).
func supersedes(reason MissReason) bool {
	switch reason {
	case MissThreshold, MissMismatch, MissPartialRefused, MissCostModel:
		return true
	}
	return false
}

// The CPU tier path (DecodeMemory's CPUTierTokens, threshold.PathPeer).
// A decode engine with vLLM's OffloadingConnector writes each turn's
// sealed blocks through to its CPU tier, where they outlive the GPU hold:
// the ledger records, with each retained turn, its decode engine and the
// tokens that tier then holds of it (budget.Placement, in handles.retain),
// and counts the tokens the later turns on each engine touch there (the
// LRU stack distance: a conversation counts once, at its latest turn),
// from which budget.Placement.Resident estimates what is left (LRU, tail
// first). A turn that
// attaches no GPU hold and goes through a prefill leg (the hold was
// released, expired, superseded, or the Chooser chose to recompute) has
// that leg carry remote_kv_source naming the engine's peer tier, when the
// estimate makes the pull cheaper than computing those tokens
// (threshold.Rates.PeerSaves: the Chooser's rates when it is a
// threshold.CostModel). The pull is by block hash: the prefill engine
// loads the chunks the tier still holds up to the first it lacks and
// computes the rest, so an estimate that is wrong costs a lookup, never a
// wrong token. A decode engine that is ejected or no longer listed is not
// asked (a lost peer can hold the pull up to vLLM's load timeout).

// placedOf reads the ledger's record of the conversation's last retained
// turn into f, under the first of its keys that has one.
func placedOf(t *turn, f *found) {
	m := t.r.mem
	if !m.cfg.on || !m.cfg.tier.On() {
		return
	}
	now := m.clock()
	for _, k := range f.cands.Keys {
		p, after, ok := m.ledger.Placed(k, now)
		if !ok || p.Decode == "" {
			continue
		}
		f.placed, f.placedKey = p, k
		f.resident = p.Resident(m.cfg.tier.Tokens, after, t.r.shapes.known(t.r.decode.find(p.Decode)))
		return
	}
}

// tierFirst reports whether the found hold is left for the CPU tier
// (DecodeMemory.CPUTierFirst): its decode engine's tier is estimated to
// hold all of it and the engine is eligible, so the turn pulls from the
// tier without verifying (peerPath), and the hold is released.
func tierFirst(t *turn, f *found) bool {
	r := t.r
	if !r.mem.cfg.tierFirst || f.expired || f.placed.Decode == "" || f.placed.Decode != f.e.Endpoint {
		return false
	}
	bs := max(r.shapes.known(r.decode.find(f.e.Endpoint)), 1)
	return f.resident >= f.e.Tokens-bs && tierRates(r).PeerSaves(f.resident, f.resident) > 0 && r.decode.eligible(f.e.Endpoint) != nil
}

// tierRates are the rates a pull from a CPU tier is weighed with: the
// Chooser's when it is a threshold.CostModel, else the defaults.
func tierRates(r *Router) threshold.Rates {
	if cm, ok := r.chooser.(*threshold.CostModel); ok {
		return cm.Rates()
	}
	return threshold.DefaultRates()
}

// peerPath decides whether the turn's prefill leg pulls from the CPU tier
// of the conversation's last decode engine (f.placed) and returns w with
// the pull: only a turn that attaches no GPU hold and goes through a
// prefill leg. With decode-local turns on (a Chooser), a turn that took
// no handle from the Store may go decode-local instead: the decode engine
// reloads the history from its own tier and computes the suffix.
func peerPath(ctx context.Context, t *turn, f *found, w way) way {
	r := t.r
	if f.placed.Decode == "" || w.h.handle != nil || w.local != nil {
		return w
	}
	ep := r.decode.eligible(f.placed.Decode)
	if ep == nil || f.resident <= 0 {
		r.stats.peerSkipped.Add(1)
		return w
	}
	host, port, ok := r.mem.cfg.tier.Addr(ep.url, ep.ep.URL, ep.ep.Rank)
	if !ok {
		r.stats.peerSkipped.Add(1)
		return w
	}
	pull := true
	if r.chooser != nil && w.rel == nil && f.key == "" {
		w, pull = tierChoice(ctx, t, f, w, ep)
		if w.local != nil {
			return w
		}
	} else {
		pull = tierRates(r).PeerSaves(f.resident, w.prompt) > 0
	}
	if !pull {
		r.stats.peerSkipped.Add(1)
		return w
	}
	r.stats.peerPulls.Add(1)
	w.peer = peerPull{decode: f.placed.Decode, host: host, port: port, resident: f.resident}
	t.rec.PeerSource, t.rec.PeerTokens = f.placed.Decode, peertier.Loadable(f.resident, w.prompt, r.shapes.known(ep))
	if w.chose.Path == "" || w.chose.Path == threshold.PathRecompute || w.chose.Path == threshold.PathPull {
		t.rec.Choice = threshold.PathPeer
	}
	return w
}

// tierChoice asks the Chooser, for a turn whose history only the decode
// engine ep's CPU tier holds, whether to pull it to a prefill engine
// (pull true), go decode-local on ep (w.local), or recompute; the
// prompt's tokens come from its render (as verification's do). A turn
// whose prompt cannot be counted pulls.
func tierChoice(ctx context.Context, t *turn, f *found, w way, ep *endpoint) (way, bool) {
	r := t.r
	n := w.prompt
	if tp, ok := t.proof.(*tokenProof); ok && n <= 0 {
		if ids, err := tp.promptTokens(ctx); err == nil {
			n = len(ids)
		}
	}
	if n <= 1 {
		return w, true
	}
	in := threshold.Turn{PromptTokens: n, ReusableTokens: min(f.resident, n-1), Decode: ep.url,
		DecodeInFlight: int(ep.inflight.Load()), FromCPU: true}
	c := r.chooser.Choose(in)
	w.prompt = n
	t.rec.Choice, t.rec.EstimatedTTFT, t.rec.LocalRefusal = c.Path, c.Estimate, c.Refusal
	switch c.Path {
	case threshold.PathLocal:
		r.stats.choseLocal.Add(1)
		t.rec.Reuse = ReuseLocal
		w.chose = chosen{Choice: c, asked: true, prompt: n, matched: in.ReusableTokens,
			tier: peertier.Loadable(in.ReusableTokens, n, r.shapes.known(ep))} // checked against D's cached tokens (confirmLocal)
		w.local = ep
		return w, false
	case threshold.PathRecompute:
		r.stats.choseRecompute.Add(1)
		w.chose = chosen{Choice: c, asked: true, prompt: n, matched: in.ReusableTokens}
		return w, false
	}
	// A pull from the tier is no GPU hold's: the learning Chooser is not
	// told it as one (asked stays false).
	w.chose = chosen{Choice: c}
	return w, true
}
