package kvroute

import (
	"context"
	"log/slog"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/threshold"
)

// Decode-local turns (WithDecodeLocal).
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

// choosePath asks the Chooser, for a handle verified by tokens, whether
// to attach it (PathPull), answer on its decode engine (PathLocal) or
// recompute (PathRecompute). It reports whether the handle is not to be
// attached; it has then been put back under key.
func (t *turn) choosePath(ctx context.Context, key string, e *entry.Entry, age time.Duration) bool {
	r := t.r
	if r.chooser == nil || t.tokPrompt <= 0 || t.tokVerified <= 0 {
		return false
	}
	ep := r.decode.eligible(e.Endpoint)
	if ep == nil {
		return false // the engine holding the blocks is gone or ejected: pull elsewhere
	}
	in := threshold.Turn{PromptTokens: t.tokPrompt, ReusableTokens: t.tokVerified,
		Decode: ep.url, DecodeInFlight: int(ep.inflight.Load()), HandleAge: age, RetentionTTL: r.cfg.retentionTTL}
	c := r.chooser.Choose(in)
	t.choice, t.chose = c, true
	t.rec.Choice = c.Path
	t.rec.EstimatedTTFT = c.Estimate
	t.rec.LocalRefusal = c.Refusal
	if c.Refusal == threshold.RefuseLocalBusy {
		r.stats.localBusy.Add(1)
	}
	switch c.Path {
	case threshold.PathLocal:
		r.stats.choseLocal.Add(1)
		t.putBack(ctx, key, e, age)
		t.localEP = ep
		t.hit = false
		t.rec.Reuse = ReuseLocal
		return true
	case threshold.PathRecompute:
		r.stats.choseRecompute.Add(1)
		t.putBack(ctx, key, e, age)
		t.miss(MissCostModel)
		return true
	}
	r.stats.chosePull.Add(1)
	return false
}

// runLocal sends the turn to its decode engine as a plain request. The
// decode-local reservation ends with the engine's first event (or body).
func (t *turn) runLocal(ctx context.Context) (*Response, error) {
	defer t.choice.Release()
	ep := t.localEP
	t.decodeLegs++
	dctx := t.startDecode(ctx, ep.url)
	resp, err := t.decodeOnce(dctx, ep, t.decodeBody(nil))
	t.decodeDone(dctx, resp, err)
	if err == nil {
		return resp, nil
	}
	if ctx.Err() == nil && unhealthy(err, false) {
		t.r.hp.failed(ep, err)
	}
	t.avoidD = append(t.avoidD, ep.url)
	return nil, err
}

// localFailed turns a failed decode-local leg into a plain miss: nothing
// reached the caller, and the retained handle is still in the store.
func (t *turn) localFailed(ctx context.Context, err error) {
	t.r.stats.localFailures.Add(1)
	t.r.log.LogAttrs(ctx, slog.LevelWarn, "kvroute: decode-local leg failed; running the turn as a plain prefill",
		slog.String("request_id", t.id), slog.String("engine_request_id", t.legID), slog.String("endpoint", t.localEP.url), slog.String("err", err.Error()))
	t.localEP = nil
	t.chose = false
	t.miss(MissRetry)
}

// observe reports the finished turn's engine times to a learning Chooser:
// streaming turns only, whose first event is the first token (a
// non-streaming answer arrives whole, after the last one).
func (t *turn) observe() {
	l := t.r.learner
	if l == nil || !t.chose || !t.stream || t.rec.Err != nil || t.rec.TTFT <= 0 || t.dSent.IsZero() {
		return
	}
	first := t.rec.TTFT - t.dSent.Sub(t.start)
	if first <= 0 {
		return
	}
	o := threshold.Observation{Path: t.rec.Choice, Decode: t.rec.DecodeEndpoint,
		PromptTokens: t.rec.PromptTokens, ReusableTokens: t.rec.VerifiedTokens, DecodeFirst: first}
	if o.Path != threshold.PathLocal {
		o.Prefill = t.rec.Prefill
	}
	l.Observe(o)
}
