package kvroute_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// A request with X-Dynamo-Session-Final: true ends its conversation: the
// turn runs as any other (a hit on its handle, a single engine's answer),
// and what it leaves on D is released at once by a release request, not
// retained and pinned for the TTL; the release is counted, and a turn
// that comes anyway finds nothing.
func TestSessionFinalReleasesHold(t *testing.T) {
	recs := &kvroutetest.Records{}
	c, r, srv, front := budgetRig(t, "", kvroute.WithObserver(recs), kvroute.WithDecodeMemory(kvroute.DecodeMemory{}))
	d := c.Decode[0]
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	conv.say(userText(0))
	conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
	knowCapacity(t, r)
	require.Equal(t, 1, r.DecodeKV()[0].Handles)

	conv.say(userText(1))
	conv.hear(releaseTurn(t, srv, conv.path, conv.body(), http.Header{"X-Request-Id": {"final"}, "X-Dynamo-Session-Final": {"true"}}))
	rec, ok := recs.Take("final")
	require.True(t, ok)
	assert.Equal(t, kvroute.ReuseHit, rec.Reuse, "the final turn uses the conversation's handle")
	assert.False(t, rec.Stored, "its own handle is not retained")
	assert.Equal(t, kvroute.Refusal("session_final"), rec.StoreRefusal)
	settle(t, r, func(s kvroute.Stats) bool { return s.ReleasedFinal == 1 })
	assert.Zero(t, r.DecodeKV()[0].Handles, "nothing held for the conversation")
	assert.EqualValues(t, 1, front.releases.Load(), "one release request")
	st := d.Stats()
	assert.Zero(t, st.BlocksPinned, "D holds nothing after the session's end")
	assert.Zero(t, st.TTLBlocks, "nothing left to lapse at the TTL")
	assert.Zero(t, st.WrongOutputs)

	// A turn that comes anyway is a miss, answered as a single engine's.
	conv.say(userText(2))
	conv.hear(releaseTurn(t, srv, conv.path, conv.body(), http.Header{"X-Request-Id": {"after"}}))
	rec, ok = recs.Take("after")
	require.True(t, ok)
	assert.Equal(t, kvroute.ReuseMiss, rec.Reuse)
}
