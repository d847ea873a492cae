package kvroute_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// tenantTurns runs n single-turn conversations of the tenant of API key
// key on srv (prompts sharing no prefix), each answer checked against a
// single engine's, and returns them.
func tenantTurns(t *testing.T, r *kvroute.Router, srv, key string, n int) []*conversation {
	t.Helper()
	h := http.Header{"Authorization": {"Bearer " + key}}
	var convs []*conversation
	for i := range n {
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, header: h,
			messages: []message{{Role: "system", Content: fmt.Sprintf("Conversation %s-%d. %s", key, i, systemPrompt)}}}
		conv.say(userText(i))
		conv.hear(releaseTurn(t, srv, conv.path, conv.body(), h))
		convs = append(convs, conv)
		knowCapacity(t, r)
	}
	return convs
}

// hugeBody is a chat request of tenant key's own conversation i with
// max_tokens n (0: none).
func hugeBody(key string, i int, n int) []byte {
	m := map[string]any{"model": kvroutetest.DefaultModel, "messages": []message{
		{Role: "system", Content: fmt.Sprintf("Request %s-%d. %s", key, i, systemPrompt)}, {Role: "user", Content: userText(i)}}}
	if n > 0 {
		m["max_tokens"] = n
	}
	b, _ := json.Marshal(m)
	return b
}

// settled waits until every release request sent has ended.
func settled(t *testing.T, r *kvroute.Router, front *releaseFront) kvroute.Stats {
	t.Helper()
	settle(t, r, func(s kvroute.Stats) bool {
		return requested(s)+orphanTotal(s)+s.ReleaseFailures+s.ReleaseGone >= int64(front.releases.Load())
	})
	return r.Stats()
}

// Issue 28.3: room made on arrival is bounded by what the request can
// really use on its engine. A decode engine of 1,024 tokens with a
// max_model_len of 256, mostly filled by another tenant's holds: a
// request with max_tokens 125,000 (vLLM answers 400: prompt plus
// max_tokens over max_model_len) makes no room at all, and one without
// max_tokens (counted as a default generation) makes room for at most
// max_model_len tokens, not the whole engine.
func TestRoomBoundedByWhatARequestCanUse(t *testing.T) {
	const maxLen = 256
	// No RoomRate: only what the request can use bounds its room.
	c, r, srv, front := memoryRig(t, "", 1, []kvroutetest.Option{kvroutetest.WithMaxModelLen(maxLen)},
		kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: 1, RoomRate: -1}))
	d := c.Decode[0]
	tenantTurns(t, r, srv, "key-b", 6)
	settled(t, r, front)
	kv := r.DecodeKV()[0]
	require.EqualValues(t, maxLen, kv.MaxModelLen, "read from /v1/models")
	require.Greater(t, kv.HeldTokens, kv.Capacity/2, "the other tenant's holds fill most of D")
	perHold := kv.HeldTokens / int64(kv.Handles) // the holds are of one size, give or take a block
	a := http.Header{"Authorization": {"Bearer key-a"}}

	before, notified := front.releases.Load(), d.Stats().NotifiedBlocks
	res := post(t, srv, kvroute.PathChatCompletions, hugeBody("key-a", 0, 125_000), a)
	assert.Equal(t, http.StatusBadRequest, res.status, "%s", res.raw)
	s := settled(t, r, front)
	assert.EqualValues(t, 1, s.RoomRejected)
	assert.Equal(t, before, front.releases.Load(), "a request the engine rejects makes no room")
	assert.Equal(t, notified, d.Stats().NotifiedBlocks)
	assert.Equal(t, kv.Handles, r.DecodeKV()[0].Handles, "every hold survived")

	body := hugeBody("key-a", 1, 0)
	res = post(t, srv, kvroute.PathChatCompletions, body, a)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	want, err := kvroutetest.Reference(kvroute.PathChatCompletions, body)
	require.NoError(t, err)
	assert.Equal(t, want.Text, res.text)
	settled(t, r, front)
	freed := int64(d.Stats().NotifiedBlocks-notified) * 16
	t.Logf("held %d tokens in %d holds; the request without max_tokens freed %d", kv.HeldTokens, kv.Handles, freed)
	assert.LessOrEqual(t, freed, maxLen+perHold+16, "room for at most what the request can use (whole holds)")
	assert.Positive(t, r.DecodeKV()[0].Handles-1, "the other tenant's holds beyond it survived")
	assert.Zero(t, d.Stats().WrongOutputs)
}

// Issue 28.3: one principal repeating requests that ask for much more than
// they use (max_tokens 600 each, a few tokens generated) releases at most
// DecodeMemory's RoomRate of the other tenants' holds (half the engine's
// capacity at once, by default; the clock does not move, so nothing
// refills), then only its own: the other tenant's holds survive, and its
// conversations reuse them when they come back.
func TestRoomRateLimitsAPrincipal(t *testing.T) {
	c, r, srv, front := memoryRig(t, "", 1, nil, kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: 1}))
	d := c.Decode[0]
	b := tenantTurns(t, r, srv, "key-b", 6)
	settled(t, r, front)
	kv := r.DecodeKV()[0]
	require.Greater(t, kv.HeldTokens, kv.Capacity/2, "the other tenant's holds fill most of D")
	a := http.Header{"Authorization": {"Bearer key-a"}}
	for i := range 5 {
		body := hugeBody("key-a", i, 600)
		res := post(t, srv, kvroute.PathChatCompletions, body, a)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		want, err := kvroutetest.Reference(kvroute.PathChatCompletions, body)
		require.NoError(t, err)
		assert.Equal(t, want.Text, res.text)
	}
	s := settled(t, r, front)
	assert.Positive(t, s.ReleasedRoom)
	assert.Positive(t, s.RoomLimited, "the principal's room was cut")
	// The other tenant's conversations come back: those whose hold
	// survived reuse it.
	hits := 0
	for i, conv := range b {
		conv.say(userText(i + 1))
		body := conv.body()
		res := post(t, srv, conv.path, body, conv.header)
		require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
		want, err := kvroutetest.Reference(conv.path, body)
		require.NoError(t, err)
		assert.Equal(t, want.Text, res.text)
		if res.header.Get("X-Bidikv-Reuse") == string(kvroute.ReuseHit) {
			hits++
		}
	}
	perHold := kv.HeldTokens / int64(kv.Handles)
	maxLost := int((int64(kvroute.Defaults().DecodeMemory.RoomRate*float64(kv.Capacity)) + perHold - 1) / perHold)
	t.Logf("%d of %d conversations of the other tenant reused their hold (at most %d lost); %d room arrivals cut", hits, len(b), maxLost, s.RoomLimited)
	assert.GreaterOrEqual(t, hits, len(b)-maxLost, "at most RoomRate × capacity of the other tenant's holds released")
	assert.Positive(t, hits)
	assert.Zero(t, d.Stats().WrongOutputs)
}

// Issue 28.3: a turn makes room once, whatever decode legs it sends: a leg
// that fails after room was made on its engine is redone on another,
// where no room is made again.
func TestRoomOncePerTurn(t *testing.T) {
	c, r, srv, front := memoryRig(t, "", 2, nil, kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: 1}))
	for i := 0; ; i++ {
		require.Less(t, i, 12, "both decode engines hold a conversation")
		tenantTurns(t, r, srv, fmt.Sprintf("key-%d", i), 1)
		if kv := r.DecodeKV(); kv[0].Handles > 0 && kv[1].Handles > 0 {
			break
		}
	}
	settled(t, r, front)
	for _, e := range c.Decode {
		e.FailNext(1, http.StatusServiceUnavailable)
	}
	n0, n1 := c.Decode[0].Stats().NotifiedHolds, c.Decode[1].Stats().NotifiedHolds
	body := hugeBody("key-x", 0, 900)
	res := post(t, srv, kvroute.PathChatCompletions, body, nil)
	require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
	want, err := kvroutetest.Reference(kvroute.PathChatCompletions, body)
	require.NoError(t, err)
	assert.Equal(t, want.Text, res.text)
	s := settled(t, r, front)
	require.Positive(t, s.ReleasedRoom, "room was made")
	d0, d1 := c.Decode[0].Stats().NotifiedHolds-n0, c.Decode[1].Stats().NotifiedHolds-n1
	assert.True(t, d0 == 0 || d1 == 0, "room made on one engine only (%d, %d)", d0, d1)
}
