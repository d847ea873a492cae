package kvroute

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"net/http"
	"strings"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/retention/budget"
)

// retainer is the one value Do owns for a turn (do.go builds it): what
// the legs learned across attempts (tries, which a redo keeps), how the
// turn ran, what the retain phase needs of the phases before it, and what
// the learning Chooser observes when the turn ends. Do hands it to the
// Response, which reports to it once D's answer is whole (kept) and when
// the turn is over (end, do.go); Do's own failures end the turn there too.
type retainer struct {
	t *turn
	tries
	cands       Candidates    // the Identifier's, for Key
	conv        int           // the conversation's turn number (found.turn)
	decodeLocal bool          // the answer is a decode-local leg's: no handle is expected
	prefill     string        // the engine of the turn's last prefill attempt
	took        time.Duration // the last prefill phase, from its first attempt to P's answer
	chose       chosen        // the Chooser's decision (lookup.go), released when the turn ends
	// placed is the ledger's record of the conversation's last retained
	// turn and placedKey its key (lookup.go, placedOf); prompt the
	// prompt's tokens (0: unknown): for the CPU tier's record of this
	// turn (placement).
	placed    budget.Placement
	placedKey string
	prompt    int
	resp      *Response // the answer Do handed on, nil before
	// retained: kept ran; refusal is why the turn retains nothing ("" when
	// it stored, or kept has not run).
	retained bool
	refusal  Refusal
	ended    bool // end ran
	failed   bool // the turn ended with an error it reports (TurnRecord.Err)
}

// answer is what a Response reports to the retain phase once D's answer is
// whole: the decode engine and how its leg ran, D's handle (nil: none) and
// where the parse of D's answer found its block list, the reply, and the
// token ids the answer carried.
type answer struct {
	decode       string
	added, asked bool // the leg asked D for token ids: on the client's behalf, or the client itself
	streamed     bool // D's answer is a stream (not a buffered turn's body)
	notJSON      bool // D's body was JSON but not an object: nothing to capture
	handle       []byte
	blocks       jsonraw.Known
	reply        *Reply
	ids          tokenIDs
}

// kept is the retain phase, run once a turn, when D's answer is whole: it
// stores D's handle for the next turn or records why not.
func (rt *retainer) kept(a answer) {
	rt.t.rec.calls.retain++
	if rt.retained {
		return
	}
	rt.retained = true
	why, stored := retain(rt, a)
	rt.refusal = why
	rt.t.rec.StoreRefusal, rt.t.rec.Stored = why, stored
}

// refused records why the turn's retain came to nothing when its stream
// ended early or broke after D's answer was reported (or before), over
// what kept recorded.
func (rt *retainer) refused(why Refusal) {
	rt.refusal = why
	rt.t.rec.StoreRefusal = why
}

// retain stores D's handle for the next turn and returns "" and true, or
// why it did not: when the turn ended normally, under the key the
// Identifier derives from the request and the reply, with the fingerprint
// the turn's verification seals. It runs when a non-streaming answer has
// been read, and for a stream before the client sees its final event, so
// that a client that sends its next turn at once finds the handle.
func retain(rt *retainer, a answer) (Refusal, bool) {
	t := rt.t
	r := t.r
	hi, why, ok := retainable(rt, a)
	if why == RefuseDecodeLocal {
		rt.placeLocal(a)
	}
	if !ok {
		// D holds whatever handle it answered with: not kept, it is
		// released (releaser.go, orphans).
		orphaned(t, a.decode, a.handle, releaseRefused)
		return why, false
	}
	if v, ok := t.req.Field("n"); ok && !jsonraw.IsNull(v) {
		if n, ok := lenientInt(v); !ok || n != 1 {
			// Which choice's tokens D's blocks hold is unknown.
			r.stats.refusals.Add(1)
			orphaned(t, a.decode, a.handle, releaseNChoices)
			return RefuseN, false
		}
	}
	if r.mem.cfg.on && sessionFinal(t.req.Header) {
		// The client ended the session: no next turn will attach the
		// hold, so D's blocks are released now, not kept for the TTL.
		orphaned(t, a.decode, a.handle, releaseFinal)
		return refuseSessionFinal, false
	}
	ids := a.ids
	ids.blockSize, ids.prefill = r.shapes.known(r.decode.find(a.decode)), rt.prefill
	fp, later := t.proof.seal(hi.Tokens, ids)
	// The fingerprint is built in a pooled buffer, copied into the entry.
	defer t.bufs.put(fp)
	ret, err := r.ident.Key(t.req, rt.cands, a.reply)
	switch {
	case err != nil:
		r.stats.refusals.Add(1)
		orphaned(t, a.decode, a.handle, releaseRefused)
		return RefuseIdentifierError, false
	case ret.Key == "" || (ret.Refusal != "" && fp == nil && later == nil):
		// A refusal with a key: the turn may be retained, but only for
		// token verification.
		r.stats.refusals.Add(1)
		orphaned(t, a.decode, a.handle, releaseRefused)
		return ret.Refusal, false
	}
	// The store entry compacts the handle where Check found its list.
	e := entry.Entry{Created: r.cfg.clock(), Endpoint: a.decode, Tokens: hi.Tokens, Check: ret.Check,
		ContentOK: ret.Refusal == "", FP: fp, Handle: a.handle, Blocks: hi.Blocks,
		Turn: max(rt.conv, 1), ToolCalls: toolCalls(a.reply), Model: t.req.model(), API: apiCode(t.req.Path), Prefill: rt.prefill}
	tenant := t.req.tenant
	if later == nil {
		return r.handles.retain(t.values, ret.Key, tenant, e, rt.tierPlacement(e), t.id)
	}
	// The fingerprint comes later, perhaps after the turn: the entry
	// keeps copies of the turn's buffers.
	e.Check, e.Handle = bytes.Clone(ret.Check), bytes.Clone(a.handle)
	key, id, values, pl := ret.Key, t.id, t.values, rt.tierPlacement(e)
	refusal, stored, pending := later(func(fp fingerprint.Fingerprint) (Refusal, bool) {
		if fp == nil {
			// No render to seal the entry with: not kept, released.
			r.mem.rel.orphan(e, releaseRefused)
			return RefuseUnrendered, false
		}
		e.FP = fp
		return r.handles.retain(values, key, tenant, e, pl, id)
	})
	if pending {
		return RefuseRenderPending, false
	}
	if refusal == RefuseUnrendered && r.renders.caps.missingAny(rt.prefill, t.req.api.render) {
		t.lacks(missingRenderRoute)
	}
	return refusal, stored
}

// sessionFinal reports whether a request ends its session: Dynamo's
// X-Dynamo-Session-Final: true (any case). Its turn runs as any other,
// with the conversation's handle; what it leaves on D is released after
// it, with decode memory management on (off: retained, as every handle).
func sessionFinal(h http.Header) bool {
	return strings.EqualFold(strings.TrimSpace(h.Get("X-Dynamo-Session-Final")), "true")
}

// retainable checks D's handle before anything is keyed: it returns what
// Check read of it (remote_num_tokens, where its block list is) and true,
// or why the turn retains nothing.
func retainable(rt *retainer, a answer) (kvhandle.Info, Refusal, bool) {
	t := rt.t
	r := t.r
	switch {
	case a.notJSON:
		return kvhandle.Info{}, RefuseNotJSON, false
	case !r.cfg.reuse || t.req.api.kind == passThrough:
		return kvhandle.Info{}, RefuseReuseOff, false
	case rt.decodeLocal:
		// A plain request: no handle expected, the earlier one stays.
		return kvhandle.Info{}, RefuseDecodeLocal, false
	case a.handle == nil:
		return kvhandle.Info{}, noDecodeHandle(rt, a), false
	}
	if a.streamed {
		r.learned.sawStream(a.decode, t.req.Path, true)
	} else {
		r.learned.sawHandle(a.decode)
	}
	if !finishedNormally(a.reply.FinishReason) {
		return kvhandle.Info{}, refuseFinishPrefix + Refusal(a.reply.FinishReason), false
	}
	hi, err := r.shapes.check(context.Background(), r.decode.find(a.decode), a.handle, a.blocks)
	if err != nil {
		why := RefuseUnusableHandle
		if errors.Is(err, kvhandle.ErrInvalid) {
			why = RefuseInvalidHandle
			if !errors.Is(err, kvhandle.ErrBlockCount) { // counted and logged by shapes
				r.invalidHandle(PhaseDecode, a.decode, err)
			}
		}
		return kvhandle.Info{}, why, false
	}
	r.restarts.sawEngineID(a.decode, hi.EngineID())
	if hi.PushMode {
		r.stats.pushHandles.Add(1)
		return hi, RefusePushHandle, false
	}
	return hi, "", true
}

// noDecodeHandle returns why a decode answer without a handle retains
// nothing: none expected (D prefilled by itself, or did not finish
// normally), a stream of an API or engine that carries none (learned.go),
// or an engine that should have sent one.
func noDecodeHandle(rt *retainer, a answer) Refusal {
	t := rt.t
	r := t.r
	// D emits a handle when it finished normally and was sent P's (a
	// plain request, the local fallback, gets none). A complete stream
	// whose reply names no finish reason (Messages streams end with
	// message_stop) finished normally.
	normal := finishedNormally(a.reply.FinishReason)
	expected := !rt.local && normal
	switch {
	case a.streamed && (rt.local || !(normal || a.reply.FinishReason == "")):
		return RefuseNoStreamHandle
	case a.streamed && (!t.req.api.streamHandles || r.learned.streams(a.decode, t.req.Path) != capability.Present):
		// The API's streams never carry one (vLLM's Messages), or the
		// engine's never did (stock vLLM without PR #40186).
		noStreamHandle(t, a.decode)
		return RefuseNoStreamHandle
	}
	if expected {
		r.stats.noDecodeHandle.Add(1)
		t.rec.NoHandle = PhaseDecode
		if !a.streamed {
			t.lacks(r.learned.noHandle(a.decode, t.req.Path, PhaseDecode))
		}
		r.log.once(context.Background(), "no_decode_handle:"+a.decode,
			"kvroute: a decode engine finished a turn without kv_transfer_params; nothing is retained (is kv_connector_extra_config.bidirectional_kv_xfer on?)",
			slog.String("endpoint", a.decode))
	}
	return RefuseNoHandle
}

// finishedNormally reports whether a reply's finish reason, in chat's
// terms (each API's reader maps its own into them: Messages' end_turn and
// stop_sequence to "stop", max_tokens to "length", tool_use to
// "tool_calls"; a Responses status completed to "stop", incomplete for
// max_output_tokens to "length", whatever its output items), is a normal
// finish: the engine stopped (EOS, a stop string or token) or reached
// its length cap, the two finishes on which vLLM's connector holds D's
// blocks and returns a handle (nixl/pull_scheduler.py request_finished:
// FINISHED_STOPPED, FINISHED_LENGTH_CAPPED). "tool_calls" is such a
// finish as chat reports it when the tool parser found calls under
// tool_choice auto or required (chat_completion/serving.py; a named
// tool_choice finishes as "stop"). Anything else (abort, error,
// repetition, an engine's own) is not.
func finishedNormally(reason string) bool {
	switch reason {
	case "stop", "length", "tool_calls":
		return true
	}
	return false
}

// toolCalls reports whether the reply ended in tool calls (a chat reply's
// tool_calls or finish_reason tool_calls, a Responses function call, a
// Messages tool_use block): the client's next request, the tools'
// results, usually follows within seconds.
func toolCalls(reply *Reply) bool {
	return len(reply.ToolCalls) > 2 || reply.FinishReason == "tool_calls"
}

// tierPlacement is the ledger's record of the turn e retains
// (budget.Placement): its prefill engine and, with a CPU tier
// (DecodeMemory's CPUTierTokens), the rest of placement's record.
func (rt *retainer) tierPlacement(e entry.Entry) budget.Placement {
	if !rt.t.r.mem.cfg.tier.On() {
		return budget.Placement{Prefill: e.Prefill}
	}
	return rt.placement(e.Prefill, e.Endpoint, rt.prompt, e.Tokens)
}

// placement is the ledger's record of this turn, prefilled on prefill and
// run on decode with tokens (prompt of them its prompt's): what the
// decode engine's tier holds of it once it ends, and the conversation's
// last record when that turn ran on decode too: this turn touched that
// history again, so the ledger counts it once (budget.Placement.Prior).
func (rt *retainer) placement(prefill, decode string, prompt, tokens int) budget.Placement {
	r := rt.t.r
	p := budget.Placement{Prefill: prefill, Decode: decode,
		Tokens: r.mem.cfg.tier.Held(prompt, tokens, r.shapes.known(r.decode.find(decode)))}
	if rt.placed.Decode == decode {
		p.Prior = rt.placedKey
	}
	return p
}

// placeLocal records where a decode-local turn's KV is, which leaves no
// handle and no hold: its decode engine reloaded the history in its CPU
// tier and wrote the rest there (every request touches its whole sequence
// in the tier), so the ledger counts the access against the other records
// of that engine, and the conversation's next turn finds this record
// (under the turn's key, with the last prefill engine carried over).
func (rt *retainer) placeLocal(a answer) {
	t := rt.t
	r := t.r
	if !r.mem.cfg.on || !r.mem.cfg.tier.On() || a.reply == nil || !finishedNormally(a.reply.FinishReason) {
		return
	}
	ret, err := r.ident.Key(t.req, rt.cands, a.reply)
	if err != nil || ret.Key == "" {
		return
	}
	prompt, tokens := rt.prompt, rt.prompt
	if a.ids.ok {
		prompt = max(prompt, len(a.ids.prompt))
		tokens = prompt + len(a.ids.generated)
	}
	if tokens <= 0 {
		return
	}
	r.mem.ledger.SetPlaced(ret.Key, rt.placement(rt.placed.Prefill, a.decode, prompt, tokens), r.cfg.clock())
}
