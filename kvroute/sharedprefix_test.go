package kvroute_test

import (
	"fmt"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention/budget"
)

// sharedSystemPrompt is about words tokens (one word a token) that every
// conversation of TestSharedPrefixCountedOnce begins with.
func sharedSystemPrompt(words int) string {
	var b strings.Builder
	b.WriteString("You are an agent.")
	for i := range words {
		fmt.Fprintf(&b, " w%d", i)
	}
	return b.String()
}

// Eight conversations that share a 4k-token system prompt, in token
// verification, on one decode engine with prefix caching (blocks of 16):
// D stores the shared blocks once, and the router's ledger counts what D
// pins, within a block per hold (each hold's last, partial block), not
// eight times the prompt; at a capacity where what D pins fits the
// budget, no hold is released for memory that does not exist. The ledger
// counts sharing by granules of budget.PrefixGranule tokens: here the
// conversations part at a granule's start, and the count is D's. A prompt
// of 4,000 words parts them within a granule, whose blocks in common are
// counted for each conversation: the ledger counts at least what D pins
// and at most a granule more per conversation.
func TestSharedPrefixCountedOnce(t *testing.T) {
	for _, words := range []int{4096, 4000} {
		t.Run(fmt.Sprint(words), func(t *testing.T) { sharedPrefixCountedOnce(t, words) })
	}
}

func sharedPrefixCountedOnce(t *testing.T, words int) {
	const blocks = 1024 // 16,384 tokens: the holds pin about 4,600
	c, r, srv, front := memoryRig(t, "", 1,
		[]kvroutetest.Option{kvroutetest.WithNumBlocks(blocks), kvroutetest.WithBlockSize(16), kvroutetest.WithPrefixCaching(true)},
		kvroute.WithDecodeMemory(kvroute.DecodeMemory{}),
		kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyTokens}))
	system := sharedSystemPrompt(words)
	const convs = 8
	var all []*conversation
	for i := range convs {
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: system}}}
		conv.say(fmt.Sprintf("Conversation %d. %s", i, userText(i)))
		conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
		all = append(all, conv)
		if i == 0 {
			knowCapacity(t, r)
		}
	}
	for i, conv := range all { // each hold replaced by its next turn's
		conv.say(userText(100 + i))
		conv.hear(releaseTurn(t, srv, conv.path, conv.body(), nil))
	}
	kv := r.DecodeKV()[0]
	ds := c.Decode[0].Stats()
	pinned := int64(ds.BlocksPinned) * 16
	t.Logf("D pins %d tokens; the ledger: %d handles, %d tokens, %d held tokens; capacity %d, budget %d",
		pinned, kv.Handles, kv.Tokens, kv.HeldTokens, kv.Capacity, kv.Budget)
	require.Equal(t, convs, kv.Handles, "a hold per conversation")
	require.EqualValues(t, blocks*16, kv.Capacity)
	assert.Greater(t, kv.Tokens, int64(convs*4096), "the holds' tokens, each with the prompt")
	if words == 4096 {
		assert.InDelta(t, pinned, kv.HeldTokens, float64(convs*16), "the ledger counts what D pins, within a block a hold")
	} else {
		assert.GreaterOrEqual(t, kv.HeldTokens, pinned-convs*16, "never less than D pins, but a block a hold")
		assert.LessOrEqual(t, kv.HeldTokens, pinned+convs*budget.PrefixGranule, "over by a granule a hold at most")
		assert.Greater(t, kv.HeldTokens, pinned, "the granule where they part is counted for each")
	}
	s := r.Stats()
	assert.Zero(t, s.ReleasedBudget+s.ReleasedRoom, "no hold released for memory that does not exist")
	assert.Zero(t, front.releases.Load(), "no release request")
	assert.Zero(t, s.PrefixUnshared)
	assert.Zero(t, ds.WrongOutputs)
}
