package kvroutetest_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func turnBody(t *testing.T, kv any, msgs ...map[string]any) []byte {
	t.Helper()
	m := map[string]any{"model": "sim-model", "messages": msgs}
	if kv != nil {
		m["kv_transfer_params"] = kv
	}
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return b
}

func user(s string) map[string]any      { return map[string]any{"role": "user", "content": s} }
func assistant(s string) map[string]any { return map[string]any{"role": "assistant", "content": s} }

// llm-d's P2P path (docs/cpu-tier.md section 4): D writes its generated
// chunks through to its CPU tier (offload_prompt_only false), and the next
// turn, sent to another engine with remote_kv_source naming D's peer
// tier, pulls the history's whole chunks, generated ones included, up to
// the first chunk D does not hold (P2PSecondaryTierManager,
// _maximal_prefix_lookup), and computes the rest. With
// offload_prompt_only (vLLM's default) only turn 1's prompt chunks are
// there. Either way the answer is Reference's: keys hash the tokens, so a
// pulled chunk never carries another prefix's KV.
func TestCPUTierPeerPullOfGeneratedHistory(t *testing.T) {
	for _, generated := range []bool{true, false} {
		reg := kvroutetest.NewRegistry()
		tier := kvroutetest.CPUTier{Chunks: 512, OffloadGenerated: generated, P2P: true}
		d := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithCPUTier(tier))
		p := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg),
			kvroutetest.WithCPUTier(kvroutetest.CPUTier{Chunks: 512, P2P: true}))

		q1 := user("tell me about the sea and the ships on it, the harbors, the tides and the winds")
		turn1 := turnBody(t, nil, q1)
		a1 := postJSON(t, d.URL(), turn1)
		ref1, err := kvroutetest.Reference(chatPath, turn1)
		require.NoError(t, err)
		require.Equal(t, ref1.Text, a1.text)

		host, port, ok := d.RankP2PChannel(0)
		require.True(t, ok)
		src := map[string]any{"remote_kv_source": map[string]any{"kv_request_id": "turn-2", "remote_host": host, "remote_port": port}}
		turn2 := turnBody(t, src, q1, assistant(a1.text), user("and what about the rivers that run into it"))
		a2 := postJSON(t, p.URL(), turn2)
		ref2, err := kvroutetest.Reference(chatPath, turn2)
		require.NoError(t, err)
		require.Equal(t, ref2.Text, a2.text, "generated=%v", generated)

		reqs := p.Requests()
		rec := reqs[len(reqs)-1]
		history := ref1.PromptTokens + ref1.CompletionTokens - 1 // D computed these positions
		common := 0
		for common < len(ref2.PromptTokenIDs) && common < len(ref1.PromptTokenIDs)+len(ref1.TokenIDs) {
			var want uint32
			if common < len(ref1.PromptTokenIDs) {
				want = ref1.PromptTokenIDs[common]
			} else {
				want = ref1.TokenIDs[common-len(ref1.PromptTokenIDs)]
			}
			if ref2.PromptTokenIDs[common] != want {
				break
			}
			common++
		}
		if generated {
			require.Greater(t, common, ref1.PromptTokens, "turn 2 re-renders the reply")
			require.Equal(t, min(common, history)/16*16, rec.PeerTokens, "every whole chunk of the shared history")
			require.Greater(t, rec.PeerTokens, ref1.PromptTokens/16*16, "generated chunks reused")
		} else {
			require.Equal(t, ref1.PromptTokens/16*16, rec.PeerTokens, "prompt chunks only: the first reply chunk misses")
		}
		require.Equal(t, rec.PeerTokens, rec.TierTokens)
		require.Equal(t, ref2.PromptTokens-rec.PeerTokens, rec.ComputedTokens)
		s := p.Stats()
		require.Equal(t, 1, s.CPUPeerPulls)
		require.Equal(t, 1, s.CPUPeerMisses)
		require.Zero(t, s.WrongOutputs)
		require.Equal(t, rec.PeerTokens/16, d.Stats().CPUChunksServed)
	}
}
