package kvroute

import (
	"context"

	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
)

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
