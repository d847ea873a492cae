package kvroute

import (
	"context"
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
	"github.com/bidikv/bidikv/kvroute/internal/observed"
)

// Extension example: a verification mode is one file (this one) and one
// registration line (its entry in verifications; here, in the test). The
// toy mode "length" attaches a retained handle whole when the new prompt
// is at least as long, in bytes of messages, as the one its fingerprint
// sealed: a made-up rule, unsafe for real use, that shows the seam: the
// turn asks the proof to prepare, check and seal, and never which mode
// runs.
const verifyLength VerificationMode = "length"

type lengthProof struct{ t *turn }

func newLengthProof(t *turn) proof { return lengthProof{t} }

// prepare needs nothing beyond the request.
func (lengthProof) prepare(context.Context, *found) MissReason { return "" }

// check compares the request's messages with the length the handle's
// "fingerprint" recorded.
func (p lengthProof) check(f *found) (verified, MissReason) {
	p.t.rec.Verification = verifyLength
	msgs, _ := p.t.req.Field("messages")
	if len(f.e.FP) == 0 || len(msgs) < int(f.e.FP[0]) {
		return verified{}, MissMismatch
	}
	return verified{tokens: f.e.Tokens}, ""
}

// seal records the length of the request's messages (up to 255 bytes).
func (p lengthProof) seal(int, tokenIDs) (fingerprint.Fingerprint, wait) {
	msgs, _ := p.t.req.Field("messages")
	fp := p.t.bufs.get(1)
	fp[0] = byte(min(len(msgs), 255))
	return fp, nil
}

func TestExtendVerificationMode(t *testing.T) {
	verifications[verifyLength] = newLengthProof // the registration line
	t.Cleanup(func() { delete(verifications, verifyLength) })

	e := newToyEngine(t, func(string, map[string]json.RawMessage) []byte {
		return []byte(`{"choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}`)
	})
	obs := &observed.Log[TurnRecord]{}
	_, url := toyRouter(t, e, WithObserver(ObserverFunc(obs.Add)), WithVerification(Verification{Mode: verifyLength}), WithThreshold(0))

	first := `{"model":"m","messages":[{"role":"user","content":"hi"}]}`
	status, h, body := toyPost(t, url, PathChatCompletions, first)
	require.Equal(t, http.StatusOK, status, "%s", body)
	assert.Equal(t, "miss", h.Get("X-Bidikv-Reuse"))
	require.True(t, obs.Last().Stored, "sealed and retained: %+v", obs.Last())

	next := `{"model":"m","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"hello"},{"role":"user","content":"and then?"}]}`
	status, h, body = toyPost(t, url, PathChatCompletions, next)
	require.Equal(t, http.StatusOK, status, "%s", body)
	assert.Equal(t, "hit", h.Get("X-Bidikv-Reuse"))
	rec := obs.Last()
	assert.Equal(t, verifyLength, rec.Verification)
	assert.Equal(t, 64, rec.ReusableTokens, "the handle whole")
	assert.Contains(t, string(e.last(true).body[kvKey]), `"remote_engine_id":"toy"`, "P pulls the retained handle")

	_, err := New(WithPrefill(e.url), WithDecode(e.url), WithVerification(Verification{Mode: "nonesuch"}))
	assert.ErrorIs(t, err, ErrInvalidConfig, "a mode must be registered")
}
