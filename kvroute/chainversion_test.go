package kvroute_test

import (
	"encoding/hex"
	"slices"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
)

// Written by the chain of version 1 (before the conversation was hashed
// in one pass, message digests chained): the anchor key and the content
// check a chat turn was retained under.
const (
	chainV1Anchor = "a:3e60b1f78c79507d14fcc3e2d373835a9f578b1759e2e7951446eca6d4af72cd"
	chainV1Check  = "8ceee6f2b2b7e697be23cb5c5c0fa70e6475abcc08b937924ffd0487acf0ee5f"
)

func chainVersionTurn(t *testing.T) (first, next *kvroute.Request, reply *kvroute.Reply) {
	t.Helper()
	hist := "You are a coding agent.\n\twith \"escapes\" and ünïcode"
	first = chatReq(t, map[string]any{"model": "m", "messages": msgs(
		map[string]any{"role": "system", "content": hist}, user("hello\nthere"))})
	reply = &kvroute.Reply{Content: "hi \"you\"\n", FinishReason: "stop"}
	next = chatReq(t, map[string]any{"model": "m", "messages": msgs(
		map[string]any{"role": "system", "content": hist}, user("hello\nthere"), assistant("hi \"you\"\n"), user("more"))})
	return first, next, reply
}

// TestChainVersion1EntriesRefused: an entry retained by the former chain
// (anchor key and content check of version 1) is not found under the
// current anchor, and its check is refused by the current one (an entry
// found by conversation id, whatever its version, is verified), while a
// current entry is found and accepted.
func TestChainVersion1EntriesRefused(t *testing.T) {
	first, next, reply := chainVersionTurn(t)
	ret := mustRetain(t, first, reply)
	oldCheck, err := hex.DecodeString(chainV1Check)
	require.NoError(t, err)
	ck := kvroute.ContinuationKeys{}
	c, err := ck.Lookup(next)
	require.NoError(t, err)
	assert.True(t, slices.Contains(c.Keys, ret.Key) && ck.Verify(next, c, ret.Check), "a current entry continues")
	assert.NotContains(t, c.Keys, chainV1Anchor, "a version 1 anchor is not looked up")
	assert.NotEqual(t, chainV1Anchor, ret.Key)
	assert.False(t, ck.Verify(next, c, oldCheck), "a version 1 check is refused")
	byID := kvroute.ContinuationKeys{ByConversationID: true}
	assert.False(t, byID.Verify(next, c, oldCheck), "by conversation id too")
}

// TestChainVersion1HintAnchorRefused: a chat turn with a conversation
// hint is anchored on the hint, not on the chain; the anchor version 1
// gave it is not looked up any more, so that an entry with a version 1
// check is not found (and were it found, its check would be refused).
func TestChainVersion1HintAnchorRefused(t *testing.T) {
	const (
		v1Anchor = "a:c1a6757f437a95a773f2fbcdbfd7279b9d72e75f99f76aa079790aa84277beb6"
		v1Check  = "02d7f4509ec10255311bf446d21ed631f03a8153949e5c783a50a88cdba061f4"
	)
	_, _, reply := chainVersionTurn(t)
	first := chatReq(t, map[string]any{"model": "m", "conversation_id": "c-1", "messages": msgs(user("hello"))})
	next := chatReq(t, map[string]any{"model": "m", "conversation_id": "c-1", "messages": msgs(user("hello"), assistant(reply.Content), user("more"))})
	ret := mustRetain(t, first, reply)
	ck := kvroute.ContinuationKeys{}
	c, err := ck.Lookup(next)
	require.NoError(t, err)
	assert.Equal(t, []string{ret.Key}, c.Keys)
	assert.True(t, ck.Verify(next, c, ret.Check), "a current entry continues")
	assert.NotEqual(t, v1Anchor, ret.Key, "a version 1 hint anchor is not looked up")
	old, err := hex.DecodeString(v1Check)
	require.NoError(t, err)
	assert.False(t, ck.Verify(next, c, old), "a version 1 check is refused")
}
