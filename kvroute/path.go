package kvroute

import "github.com/bidikv/bidikv/threshold"

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
// from the release phase (release.go), the handle the first prefill
// attempt carries to release a hold the turn does not attach.
type way struct {
	h      hit
	local  *endpoint
	miss   MissReason // why h attaches none ("" when it attaches one, or for a decode-local turn)
	prompt int        // the prompt's tokens as verification counted them, 0 when unknown
	chose  chosen
	rel    []byte
	relWhy releaseReason
}

// chosen is the Chooser's decision for a turn (asked: it was asked) and
// what it was asked of the prompt: what the learning Chooser observes when
// the turn ends (do.go, observe).
type chosen struct {
	threshold.Choice
	asked           bool
	prompt, matched int // the prompt's tokens, and those the handle's match
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
