package kvroute_test

import (
	"context"
	"encoding/json"
	"net/http"
	"net/http/httptest"
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

// A client done with a conversation it keys by id ends it with DELETE
// /v1/conversations/{id} (the OpenAI Conversations API's shape): the
// stored handle goes, its hold on D is released at once instead of
// pinning D until the TTL, the ledger counts the conversation as ended,
// and a turn that comes anyway is a miss answered as a single engine's.
// Only the principal whose conversation it is reaches it; a router keying
// conversations by content has no id to end.
func TestDeleteConversationReleasesHold(t *testing.T) {
	recs := &kvroutetest.Records{}
	c, r, srv, front := budgetRig(t, "", kvroute.WithObserver(recs), kvroute.WithDecodeMemory(kvroute.DecodeMemory{}),
		kvroute.WithIdentifier(kvroute.ContinuationKeys{ByConversationID: true}))
	d := c.Decode[0]
	owner := http.Header{"Authorization": {"Bearer key-a"}, "X-Session-Id": {"conv-a"}}
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	conv.say(userText(0))
	conv.hear(releaseTurn(t, srv, conv.path, conv.body(), owner))
	knowCapacity(t, r)
	require.Equal(t, 1, r.DecodeKV()[0].Handles)
	require.NotZero(t, d.Stats().BlocksPinned)

	del := func(id, key string) (int, map[string]any) {
		req, err := http.NewRequest(http.MethodDelete, srv+"/v1/conversations/"+id, nil)
		require.NoError(t, err)
		req.Header.Set("Authorization", "Bearer "+key)
		res, err := http.DefaultClient.Do(req)
		require.NoError(t, err)
		defer res.Body.Close()
		var out map[string]any
		require.NoError(t, json.NewDecoder(res.Body).Decode(&out))
		return res.StatusCode, out
	}
	// Another principal's DELETE of the same id reaches nothing of A's.
	status, out := del("conv-a", "key-b")
	assert.Equal(t, http.StatusOK, status)
	assert.Equal(t, map[string]any{"id": "conv-a", "object": "conversation.deleted", "deleted": false}, out)
	assert.Equal(t, 1, r.DecodeKV()[0].Handles, "another tenant's delete leaves the hold")

	status, out = del("conv-a", "key-a")
	assert.Equal(t, http.StatusOK, status)
	assert.Equal(t, map[string]any{"id": "conv-a", "object": "conversation.deleted", "deleted": true}, out)
	settle(t, r, func(s kvroute.Stats) bool { return s.ReleasedFinal == 1 })
	assert.Zero(t, r.DecodeKV()[0].Handles, "nothing held for the conversation")
	assert.EqualValues(t, 1, front.releases.Load(), "one release request")
	assert.Zero(t, d.Stats().BlocksPinned, "D holds nothing after the conversation's end")
	assert.Zero(t, d.Stats().WrongOutputs)

	status, out = del("conv-a", "key-a")
	assert.Equal(t, http.StatusOK, status)
	assert.Equal(t, false, out["deleted"], "a second delete finds nothing")

	conv.say(userText(1))
	h := owner.Clone()
	h.Set("X-Request-Id", "after")
	conv.hear(releaseTurn(t, srv, conv.path, conv.body(), h))
	rec, ok := recs.Take("after")
	require.True(t, ok)
	assert.Equal(t, kvroute.ReuseMiss, rec.Reuse)

	// A client gone before its delete ran (its context ended) still
	// ends the conversation, and its leaving is no Store failure.
	conv.say(userText(2))
	conv.hear(releaseTurn(t, srv, conv.path, conv.body(), owner))
	require.Equal(t, 1, r.DecodeKV()[0].Handles)
	gone, cancel := context.WithCancel(context.Background())
	cancel()
	req, err := http.NewRequestWithContext(gone, http.MethodDelete, "/v1/conversations/conv-a", nil)
	require.NoError(t, err)
	req.Header.Set("Authorization", "Bearer key-a")
	rw := httptest.NewRecorder()
	r.ServeHTTP(rw, req)
	assert.Equal(t, http.StatusOK, rw.Code, rw.Body.String())
	settle(t, r, func(s kvroute.Stats) bool { return s.ReleasedFinal == 2 })
	assert.Zero(t, r.DecodeKV()[0].Handles)
	assert.Zero(t, r.Stats().StoreErrors, "a client's leaving is no Store failure")

	// Only DELETE, on one id, and only where conversations have ids.
	res, err := http.Post(srv+"/v1/conversations/conv-a", "application/json", nil)
	require.NoError(t, err)
	_ = res.Body.Close()
	assert.Equal(t, http.StatusMethodNotAllowed, res.StatusCode)
	assert.Equal(t, http.MethodDelete, res.Header.Get("Allow"))
	status, out = del("a/b", "key-a")
	assert.Equal(t, http.StatusNotFound, status)
	assert.Contains(t, out, "error")
	_, _, srv2, _ := budgetRig(t, "")
	req, err = http.NewRequest(http.MethodDelete, srv2+"/v1/conversations/conv-a", nil)
	require.NoError(t, err)
	res, err = http.DefaultClient.Do(req)
	require.NoError(t, err)
	var e struct {
		Error struct{ Message string } `json:"error"`
	}
	require.NoError(t, json.NewDecoder(res.Body).Decode(&e))
	_ = res.Body.Close()
	assert.Equal(t, http.StatusNotFound, res.StatusCode)
	assert.Contains(t, e.Error.Message, "ByConversationID")
}
