package kvroute

import (
	"context"
	"log/slog"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/entry"
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
	// (release.go).
	expired bool
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
