package kvroutetest_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func jsonBody(t *testing.T, m map[string]any) []byte {
	t.Helper()
	b, err := json.Marshal(m)
	require.NoError(t, err)
	return b
}

func withKV(m map[string]any, kv any, extra ...any) map[string]any {
	out := map[string]any{"kv_transfer_params": kv}
	for k, v := range m {
		out[k] = v
	}
	for i := 0; i+1 < len(extra); i += 2 {
		out[extra[i].(string)] = extra[i+1]
	}
	return out
}

// A P→D turn over the Responses and Messages APIs through a Cluster: D's
// answer is Reference's, text and reasoning, and the prompt is chat's.
func TestClusterTurnOtherAPIs(t *testing.T) {
	const q = "tell me about the sea, in a few words please"
	chat, err := kvroutetest.Reference(kvroutetest.PathChat, body(t, nil, 0), kvroutetest.WithReasoning(true))
	require.NoError(t, err)
	tests := []struct {
		path, maxKey string
		body         map[string]any
		text         func(map[string]any) (text, reasoning string)
	}{
		{kvroutetest.PathResponses, "max_output_tokens", map[string]any{"model": "sim-model", "input": q},
			func(b map[string]any) (text, reasoning string) {
				for _, it := range b["output"].([]any) {
					item := it.(map[string]any)
					c := item["content"].([]any)[0].(map[string]any)
					if item["type"] == "reasoning" {
						reasoning = c["text"].(string)
					} else {
						text = c["text"].(string)
					}
				}
				return text, reasoning
			}},
		{kvroutetest.PathMessages, "max_tokens", map[string]any{"model": "sim-model", "max_tokens": 100,
			"messages": []any{map[string]any{"role": "user", "content": q}}},
			func(b map[string]any) (text, reasoning string) {
				for _, c := range b["content"].([]any) {
					block := c.(map[string]any)
					if block["type"] == "thinking" {
						reasoning = block["thinking"].(string)
					} else {
						text = block["text"].(string)
					}
				}
				return text, reasoning
			}},
	}
	for _, tt := range tests {
		t.Run(tt.path, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithReasoning(true))
			P, D := c.Prefill[0], c.Decode[0]
			status, pb := postPath(t, P.URL(), tt.path, jsonBody(t, withKV(tt.body, miss, tt.maxKey, 1)))
			require.Equal(t, http.StatusOK, status, string(pb))
			var p struct {
				KV json.RawMessage `json:"kv_transfer_params"`
			}
			require.NoError(t, json.Unmarshal(pb, &p))
			require.NotEmpty(t, p.KV)
			status, db := postPath(t, D.URL(), tt.path, jsonBody(t, withKV(tt.body, p.KV)))
			require.Equal(t, http.StatusOK, status, string(db))
			var d map[string]any
			require.NoError(t, json.Unmarshal(db, &d))
			require.NotNil(t, d["kv_transfer_params"], "D's handle")

			want, err := kvroutetest.Reference(tt.path, jsonBody(t, tt.body), kvroutetest.WithReasoning(true))
			require.NoError(t, err)
			text, reasoning := tt.text(d)
			assert.Equal(t, want.Text, text)
			assert.Equal(t, want.Reasoning, reasoning)
			assert.NotEmpty(t, want.Reasoning)
			assert.Equal(t, chat.PromptTokenIDs, want.PromptTokenIDs, "rendered as chat")
			assert.Equal(t, chat.Text, want.Text)
			assert.Zero(t, D.Stats().WrongOutputs)
			assert.Equal(t, want.PromptTokens, D.Stats().TokensPulledIn)
			n, err := kvroutetest.CountTokens(tt.path, jsonBody(t, tt.body))
			require.NoError(t, err)
			assert.Equal(t, want.PromptTokens, n)
		})
	}
	n, err := kvroutetest.CountTokens(kvroutetest.PathMessagesCountTokens,
		jsonBody(t, map[string]any{"model": "sim-model", "messages": []any{map[string]any{"role": "user", "content": q}}}))
	require.NoError(t, err)
	assert.Equal(t, chat.PromptTokens, n)
}
