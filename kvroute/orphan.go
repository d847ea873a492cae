package kvroute

import (
	"bytes"
	"context"
	"log/slog"

	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
)

// Orphan holds. A vLLM decode engine holds the blocks of every request
// that carried P's handle and finished normally, whether or not the
// router keeps the handle it answers with (the protocol's "Decode
// memory"). A handle the router receives and does not keep is an orphan:
// nothing would ever attach or release it, and the engine would pin its
// blocks for its TTL (480 s) while the ledger counts none of them. So
// every such handle is released at once by a release request
// (releaser.go: a one-token prefill request carrying the handle with
// remote_num_tokens 0), in the background, bounded by DecodeMemory's
// Releases, never on the turn's path, and counted by reason:
//
//   - an answer of n > 1 choices (releaseNChoices): which choice's tokens
//     the blocks hold is unknown (retain.go);
//   - a turn not retained (releaseRefused): a finish the router does not
//     retain, the Identifier's refusal, no render to seal the entry with,
//     an entry too large for the Store, reuse off;
//   - a Put that failed (releaseStoreError): released once a Take shows
//     that the Store does not hold it, since a failed Put may have stored
//     the value all the same (a Redis SET whose answer was lost), and a
//     handle in the Store may be attached by a later turn;
//   - a retained handle under the key a turn retains its own under
//     (releaseOverwritten; store.go, supersede): two turns of one
//     conversation at once, each of which looked the key up before the
//     other retained. A Put would overwrite it silently.
//
// A handle vLLM would misread or ignore, or one of push mode, is sent
// nowhere (Stats.Unreleasable), nor is anything with the management off
// (DecodeMemory's Budget negative: every hold is kept to the TTL).

// maxWaitingReleases bounds the orphans' release requests waiting for one
// of DecodeMemory's Releases: past it (a prefill engine that stopped
// answering while orphans keep coming), an orphan's hold lapses at its
// TTL and counts in Stats.ReleaseFailures.
const maxWaitingReleases = 1024

// orphaned has the hold of handle, which the turn's decode leg on engine
// answered with and the turn does not keep, released for why.
func orphaned(t *turn, engine string, handle []byte, why releaseReason) {
	if handle == nil {
		return
	}
	e := entry.Entry{Created: t.r.cfg.clock(), Endpoint: engine, Handle: handle, Model: t.req.model(), API: apiCode(t.req.Path)}
	t.r.mem.rel.orphan(e, why)
}

// releasable returns a copy of e for a release in the background, or
// false, counted, when its handle is not one to send anywhere: vLLM would
// misread or ignore it (kvhandle.Check), or it is of push mode.
func (rl *releaser) releasable(e entry.Entry) (entry.Entry, bool) {
	if !rl.mem.cfg.on {
		return entry.Entry{}, false
	}
	// No block-count check: a release reads nothing (remote_num_tokens 0).
	hi, err := kvhandle.Check(e.Handle, 0)
	if err != nil || hi.PushMode {
		rl.mem.stats.unreleasable.Add(1)
		return entry.Entry{}, false
	}
	return entry.Entry{Created: e.Created, Endpoint: e.Endpoint, Tokens: hi.Tokens, Handle: bytes.Clone(e.Handle),
		Model: e.Model, API: e.API}, true
}

// orphan releases e's hold for why, in the background; e's buffers are
// copied first (they may be the turn's).
func (rl *releaser) orphan(e entry.Entry, why releaseReason) {
	if e, ok := rl.releasable(e); ok {
		rl.queue(why, func(context.Context) (entry.Entry, bool) { return e, true })
	}
}

// unstored releases the hold of e, whose value val a Put under key failed
// to store, once a Take shows that the Store does not hold it (or takes
// it back): a failed Put may have stored it all the same. A Store that
// cannot answer the Take leaves the hold to its TTL (Stats.Unreleasable).
// An entry stored under key since (another turn's, or another router's)
// goes back untouched.
func (rl *releaser) unstored(key string, e entry.Entry, val []byte) {
	e, ok := rl.releasable(e)
	if !ok {
		return
	}
	val = bytes.Clone(val)
	rl.queue(releaseStoreError, func(ctx context.Context) (entry.Entry, bool) {
		sctx, cancel := context.WithTimeout(ctx, storeTimeout)
		defer cancel()
		v, ok, err := rl.store.Take(sctx, key)
		switch {
		case err != nil:
			rl.mem.stats.unreleasable.Add(1)
			return entry.Entry{}, false
		case ok && !bytes.Equal(v, val):
			if other, err := entry.Decode(v, nil); err == nil {
				if left := rl.mem.ttl - rl.mem.clock().Sub(other.Created); left > 0 {
					_ = rl.store.Put(sctx, key, v, left)
				}
			}
		}
		return e, true
	})
}

// queue runs a release for why in the background: get returns the entry
// to release, or false for none; the request then waits for one of
// DecodeMemory's Releases.
func (rl *releaser) queue(why releaseReason, get func(ctx context.Context) (entry.Entry, bool)) {
	if rl.waiting.Add(1) > maxWaitingReleases {
		rl.waiting.Add(-1)
		rl.mem.stats.releaseFailures.Add(1)
		rl.mem.log.once(context.Background(), "release_backlog", "kvroute: too many release requests waiting for the prefill engines; holds not released lapse at their TTL (logged once)",
			slog.Int("waiting", maxWaitingReleases))
		return
	}
	if !rl.mem.bg.run(func(ctx context.Context) {
		defer rl.waiting.Add(-1)
		e, ok := get(ctx)
		if !ok {
			return
		}
		select {
		case rl.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		defer func() { <-rl.sem }()
		rl.send(ctx, e, why)
	}) {
		rl.waiting.Add(-1)
	}
}
