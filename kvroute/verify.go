package kvroute

import (
	"context"
	"log/slog"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/threshold"
)

// Verification is the seam between the turn and how it proves that a
// retained handle's KV is the KV the next prompt needs (docs/kvroute.md,
// Verification). A mode is one file that implements proof and one entry
// in verifications; the flow never asks which mode runs. It is a
// contributor-only seam (ARCHITECTURE.md, Seams): proof is unexported, so
// only a change to kvroute adds a mode; WithVerification chooses among
// those registered.

// proof is one turn's verification in a mode: it prepares the check of the
// candidate the lookup found, checks the prompt against the handle, and
// seals the fingerprint D's new handle is retained with. It reports what it
// did in the turn's record.
type proof interface {
	// prepare readies the check of f's handle (the tokens mode renders
	// the prompt) and returns "", or why the handle cannot be attached.
	prepare(ctx context.Context, f *found) MissReason
	// check compares the request's prompt with what f's handle holds and
	// returns the verified prefix in tokens (f.e.Tokens: all of it), or
	// why none is: a result in a verified (for a miss, only its prompt,
	// when the check counted it).
	check(f *found) (verified, MissReason)
	// seal returns the fingerprint of the first tokens positions of D's
	// blocks after the turn (ids: the token ids D's answer carried), built
	// in a buffer from the turn's pool (nil: none, the handle is retained
	// under content rules only). When it is known only later (a render
	// still running), seal returns a wait instead, which the retain phase
	// calls with what to do with it.
	seal(tokens int, ids tokenIDs) (fingerprint.Fingerprint, wait)
}

// legHelper is implemented by a proof whose seal needs the legs' help: the
// decode leg to ask for token ids, a render beside the prefill leg; end
// releases what it holds when the turn ends.
type legHelper interface {
	// decodeIDs reports whether the decode leg asks D for token ids
	// (return_token_ids) for seal.
	decodeIDs() bool
	// beside is called with the prefill engine of each prefill attempt.
	beside(ep *endpoint)
	end()
}

// verifications are the modes, by WithVerification's value.
var verifications = map[VerificationMode]func(t *turn) proof{
	VerifyTokens:  newTokenProof,
	VerifyContent: newContentProof,
}

// verification makes the turn's proof in the Router's mode.
func (r *Router) verification(t *turn) proof { return verifications[r.cfg.verification](t) }

// verified is a check's result: the prefix of the new prompt, in tokens,
// that the handle's blocks hold, and, when tokens proved it, those tokens
// and the prefill engine that rendered them (the leg that carries the
// handle goes there, and its prompt ids are compared with them).
type verified struct {
	tokens   int // the prefix attached: block-aligned when cut
	matched  int // the prefix the tokens matched (TurnRecord.VerifiedTokens), 0 without tokens
	prompt   int // the new prompt's length in tokens, 0 when unknown
	ids      []uint32
	renderer *endpoint
}

// tokenIDs are the token ids a decode answer carried: the prompt's and the
// generated ones, ok when it carried both.
type tokenIDs struct {
	prompt, generated []uint32
	ok                bool
	// blockSize is the decode engine's (0: unknown): the fingerprint's
	// blocks are its blocks, where a partial read cuts.
	blockSize int
	// prefill is the engine of the turn's last prefill attempt ("" when
	// none), which seal asks whether it lacks the render route.
	prefill string
}

// wait delivers a fingerprint that comes after seal returned: it calls
// store with it and returns store's result, or pending when it will call
// store after the turn. A fingerprint that could not be made is delivered
// as nil: store refuses the entry (RefuseUnrendered) and has its hold
// released.
type wait func(store func(fingerprint.Fingerprint) (Refusal, bool)) (refusal Refusal, stored, pending bool)

// hit is the verify phase's result: the handle to attach, cut to the
// verified prefix, and how it was verified; handle nil when none is, and
// miss says why (v.prompt still counts the prompt when verification did).
type hit struct {
	handle []byte
	known  jsonraw.Known // where the store entry's expansion wrote handle's block list (none once cut)
	v      verified
	miss   MissReason
}

// verify decides whether the handle f holds may be attached to this
// request and, for a verified prefix shorter than the handle, cuts it to
// that prefix. A handle not attached stays taken: the release phase
// (lookup.go) releases it or puts it back.
func verify(ctx context.Context, t *turn, f *found) hit {
	if f.key == "" {
		return hit{}
	}
	if tierFirst(t, f) {
		t.miss(MissCostModel) // released through the prefill leg, which pulls from the tier (lookup.go)
		return hit{miss: MissCostModel}
	}
	h := verifyHandle(ctx, t, f)
	if h.miss != "" {
		t.miss(h.miss)
		return h
	}
	t.rec.Reuse = ReuseHit
	t.rec.HandleAge = f.age
	return h
}

// verifyHandle is verify's decision.
func verifyHandle(ctx context.Context, t *turn, f *found) hit {
	r := t.r
	if reason := t.proof.prepare(ctx, f); reason != "" {
		return hit{miss: reason}
	}
	v, reason := t.proof.check(f)
	if reason != "" {
		return hit{miss: reason, v: verified{prompt: v.prompt}}
	}
	missed := hit{v: verified{prompt: v.prompt}}
	t.rec.ReusableTokens = v.tokens
	if !r.policy.Reuse(threshold.Input{RemoteTokens: v.tokens}) {
		missed.miss = MissThreshold
		return missed
	}
	if v.tokens >= f.e.Tokens {
		return hit{handle: f.e.Handle, known: f.e.Blocks, v: v}
	}
	// Cut at the block size of the decode engine whose blocks the handle
	// names; unknown (or partial reads off): not cut.
	bs := r.shapes.size(ctx, r.decode.find(f.e.Endpoint))
	missed.miss = MissPartialRefused
	if bs == 0 || r.cfg.noPartial {
		r.stats.partialRefused.Add(1)
		return missed
	}
	n := v.tokens - v.tokens%bs // a block-aligned R' (fingerprint blocks may be smaller or larger)
	cut, err := kvhandle.Cut(f.e.Handle, n, bs)
	if err != nil || n == 0 {
		r.stats.partialRefused.Add(1)
		if err != nil {
			r.log.once(ctx, "partial:"+err.Error(), "kvroute: a handle cannot be read partially; such turns run as plain prefills",
				slog.String("reason", err.Error()))
		}
		return missed
	}
	t.rec.ReusableTokens = n
	if !r.policy.Reuse(threshold.Input{RemoteTokens: n}) {
		missed.miss = MissThreshold
		return missed
	}
	v.tokens = n
	t.rec.Partial = true
	r.stats.partialHits.Add(1)
	return hit{handle: cut, v: v}
}

// contentProof is VerifyContent: a handle is attached only when the
// Identifier's Verify says the request continues what was stored (for
// ContinuationKeys, that it resends the stored conversation and reply
// exactly), and then whole; nothing is fingerprinted. The tokens mode
// falls back to it for a handle without a fingerprint, or when the prompt
// could not be rendered.
type contentProof struct{ t *turn }

func newContentProof(t *turn) proof { return contentProof{t} }

func (contentProof) prepare(context.Context, *found) MissReason { return "" }

// check asks the Identifier's Verify, for a handle retained under content
// rules.
func (p contentProof) check(f *found) (verified, MissReason) {
	t := p.t
	t.rec.Verification = VerifyContent
	if !f.e.ContentOK {
		return verified{}, MissUnverified
	}
	if !t.r.ident.Verify(t.req, f.cands, f.e.Check) {
		return verified{}, MissMismatch
	}
	return verified{tokens: f.e.Tokens}, ""
}

func (contentProof) seal(int, tokenIDs) (fingerprint.Fingerprint, wait) { return nil, nil }
