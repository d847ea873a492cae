package kvroute

import (
	"bytes"
	"context"
	"errors"
	"log/slog"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
)

// retainIn is what the retain phase needs of the phases before it: the
// Identifier's candidates (for Key), how the turn ran (decode-local, or D
// prefilling by itself: no handle is expected), the decode engine that
// answered, and whether its leg asked for token ids.
type retainIn struct {
	cands        Candidates
	decodeLocal  bool
	noPrefill    bool
	decode       string
	added, asked bool
	streamed     bool // D's answer is a stream (not a buffered turn's body)
	turn         int  // the conversation's turn number (found.turn)
	// blocks is where D's handle's block list is, when the parse of D's
	// answer read it (kvhandle.ResetAnswer).
	blocks jsonraw.Known
}

// retain stores D's handle for the next turn, or records why not: when the
// turn ended normally, under the key the Identifier derives from the
// request and the reply, with the fingerprint the turn's verification
// seals. It runs when a non-streaming answer is read, and for a stream
// before the client sees its final event, so that a client that sends its
// next turn at once finds the handle.
func retain(t *turn, in retainIn, handle []byte, reply *Reply, ids tokenIDs) {
	r := t.r
	hi, ok := retainable(t, in, handle, reply)
	if !ok {
		// D holds whatever handle it answered with: not kept, it is
		// released (releaser.go, orphans).
		orphaned(t, in.decode, handle, releaseRefused)
		return
	}
	if v, ok := t.req.Field("n"); ok && !jsonraw.IsNull(v) {
		if n, ok := lenientInt(v); !ok || n != 1 {
			// Which choice's tokens D's blocks hold is unknown.
			t.rec.StoreRefusal = RefuseN
			r.stats.refusals.Add(1)
			orphaned(t, in.decode, handle, releaseNChoices)
			return
		}
	}
	ids.blockSize = r.shapes.known(r.decode.find(in.decode))
	fp, later := t.proof.seal(hi.Tokens, ids)
	// The fingerprint is built in a pooled buffer, copied into the entry.
	defer t.bufs.put(fp)
	ret, err := r.ident.Key(t.req, in.cands, reply)
	switch {
	case err != nil:
		t.rec.StoreRefusal = RefuseIdentifierError
		r.stats.refusals.Add(1)
		orphaned(t, in.decode, handle, releaseRefused)
		return
	case ret.Key == "" || (ret.Refusal != "" && fp == nil && later == nil):
		// A refusal with a key: the turn may be retained, but only for
		// token verification.
		t.rec.StoreRefusal = ret.Refusal
		r.stats.refusals.Add(1)
		orphaned(t, in.decode, handle, releaseRefused)
		return
	}
	// The store entry compacts the handle where Check found its list.
	e := entry.Entry{Created: r.cfg.clock(), Endpoint: in.decode, Tokens: hi.Tokens, Check: ret.Check,
		ContentOK: ret.Refusal == "", FP: fp, Handle: handle, Blocks: hi.Blocks,
		Turn: max(in.turn, 1), ToolCalls: toolCalls(reply), Model: t.req.model(), API: apiCode(t.req.Path)}
	tenant := t.req.tenant
	if later == nil {
		t.rec.StoreRefusal, t.rec.Stored = r.handles.retain(t.values, ret.Key, tenant, e, t.id)
		return
	}
	// The fingerprint comes later, perhaps after the turn: the entry
	// keeps copies of the turn's buffers.
	e.Check, e.Handle = bytes.Clone(ret.Check), bytes.Clone(handle)
	key, id, values := ret.Key, t.id, t.values
	refusal, stored, pending := later(func(fp fingerprint.Fingerprint) (Refusal, bool) {
		if fp == nil {
			// No render to seal the entry with: not kept, released.
			r.mem.rel.orphan(e, releaseRefused)
			return RefuseUnrendered, false
		}
		e.FP = fp
		return r.handles.retain(values, key, tenant, e, id)
	})
	if pending {
		t.rec.StoreRefusal = RefuseRenderPending
		return
	}
	if refusal == RefuseUnrendered && r.renders.caps.missingAny(t.rec.PrefillEndpoint, t.req.api.render) {
		t.lacks(missingRenderRoute)
	}
	t.rec.StoreRefusal, t.rec.Stored = refusal, stored
}

// retainable checks D's handle before anything is keyed: it returns what
// Check read of it (remote_num_tokens, where its block list is) and true,
// or records why the turn retains nothing.
func retainable(t *turn, in retainIn, handle []byte, reply *Reply) (kvhandle.Info, bool) {
	r := t.r
	switch {
	case !r.cfg.reuse || t.req.api.kind == passThrough:
		t.rec.StoreRefusal = RefuseReuseOff
		return kvhandle.Info{}, false
	case in.decodeLocal:
		// A plain request: no handle expected, the earlier one stays.
		t.rec.StoreRefusal = RefuseDecodeLocal
		return kvhandle.Info{}, false
	case handle == nil:
		noDecodeHandle(t, in, reply)
		return kvhandle.Info{}, false
	}
	if in.streamed {
		r.learned.sawStream(in.decode, t.req.Path, true)
	} else {
		r.learned.sawHandle(in.decode)
	}
	if !finishedNormally(reply.FinishReason) {
		t.rec.StoreRefusal = refuseFinishPrefix + Refusal(reply.FinishReason)
		return kvhandle.Info{}, false
	}
	hi, err := r.shapes.check(context.Background(), r.decode.find(in.decode), handle, in.blocks)
	if err != nil {
		t.rec.StoreRefusal = RefuseUnusableHandle
		if errors.Is(err, kvhandle.ErrInvalid) {
			t.rec.StoreRefusal = RefuseInvalidHandle
			if !errors.Is(err, kvhandle.ErrBlockCount) { // counted and logged by shapes
				r.invalidHandle(PhaseDecode, in.decode, err)
			}
		}
		return kvhandle.Info{}, false
	}
	r.restarts.sawEngineID(in.decode, hi.EngineID())
	if hi.PushMode {
		t.rec.StoreRefusal = RefusePushHandle
		r.stats.pushHandles.Add(1)
		return hi, false
	}
	return hi, true
}

// noDecodeHandle records a decode answer without a handle: none expected
// (D prefilled by itself, or did not finish normally), a stream of an API
// or engine that carries none (learned.go), or an engine that should have
// sent one.
func noDecodeHandle(t *turn, in retainIn, reply *Reply) {
	r := t.r
	// D emits a handle when it finished normally and was sent P's (a
	// plain request, the local fallback, gets none). A complete stream
	// whose reply names no finish reason (Messages streams end with
	// message_stop) finished normally.
	normal := finishedNormally(reply.FinishReason)
	expected := !in.noPrefill && normal
	switch {
	case in.streamed && (in.noPrefill || !(normal || reply.FinishReason == "")):
		t.rec.StoreRefusal = RefuseNoStreamHandle
	case in.streamed && (!t.req.api.streamHandles || r.learned.streams(in.decode, t.req.Path) != capability.Present):
		// The API's streams never carry one (vLLM's Messages), or the
		// engine's never did (stock vLLM without PR #40186).
		noStreamHandle(t, in)
	default:
		t.rec.StoreRefusal = RefuseNoHandle
		if expected {
			r.stats.noDecodeHandle.Add(1)
			t.rec.NoHandle = PhaseDecode
			if !in.streamed {
				t.lacks(r.learned.noHandle(in.decode, t.req.Path, PhaseDecode))
			}
			r.log.once(context.Background(), "no_decode_handle:"+in.decode,
				"kvroute: a decode engine finished a turn without kv_transfer_params; nothing is retained (is kv_connector_extra_config.bidirectional_kv_xfer on?)",
				slog.String("endpoint", in.decode))
		}
	}
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
