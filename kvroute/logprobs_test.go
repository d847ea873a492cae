package kvroute_test

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// answerLogprobs returns choices[0].logprobs of an answer as raw bytes: the
// body's, or each chunk's that has a choice.
func answerLogprobs(t *testing.T, raw []byte, stream bool) []string {
	t.Helper()
	var c struct {
		Choices []struct {
			Logprobs json.RawMessage `json:"logprobs"`
		} `json:"choices"`
	}
	if !stream {
		require.NoError(t, json.Unmarshal(raw, &c), "%s", raw)
		require.NotEmpty(t, c.Choices)
		return []string{string(c.Choices[0].Logprobs)}
	}
	var out []string
	for data := range sseData(raw) {
		if data == "[DONE]" {
			continue
		}
		c.Choices = nil
		require.NoError(t, json.Unmarshal([]byte(data), &c), "%s", data)
		if len(c.Choices) > 0 {
			out = append(out, string(c.Choices[0].Logprobs))
		}
	}
	return out
}

// Logprobs pass through the router untouched: chat (logprobs,
// top_logprobs 20) and completions (logprobs 5), streamed and not, reach
// the client byte for byte as a single engine answers them, on turn 1 and
// on turn 2 reused from D's blocks, and agree with Reference.
func TestLogprobsPassThrough(t *testing.T) {
	for _, path := range []string{kvroute.PathChatCompletions, kvroute.PathCompletions} {
		for _, stream := range []bool{false, true} {
			name := path
			if stream {
				name += " stream"
			}
			t.Run(name, func(t *testing.T) {
				c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
				url := serve(t, newRouter(t, c))
				single := kvroutetest.NewEngine(t)
				conv := &conversation{path: path, stream: stream, maxTok: 24, prompt: systemPrompt,
					extra: map[string]any{"logprobs": 5}}
				if path == kvroute.PathChatCompletions {
					conv.messages = []message{{Role: "system", Content: systemPrompt}}
					conv.extra = map[string]any{"logprobs": true, "top_logprobs": 20}
				}
				for turn := 1; turn <= 2; turn++ {
					conv.say(userText(turn))
					body := conv.body()
					got := post(t, url, path, body, nil)
					require.Equal(t, http.StatusOK, got.status, "%s", got.raw)
					want := send(t, single.URL(), path, body, nil)
					require.Equal(t, http.StatusOK, want.status, "%s", want.raw)
					lps := answerLogprobs(t, got.raw, stream)
					assert.Equal(t, answerLogprobs(t, want.raw, stream), lps, "turn %d: byte for byte", turn)
					assert.Greater(t, len(lps[len(lps)-1]), 100, "logprobs present")
					if !stream {
						ref, err := kvroutetest.Reference(path, body)
						require.NoError(t, err)
						assert.Equal(t, string(ref.Logprobs), lps[0])
					}
					if turn == 2 {
						assert.Equal(t, "hit", got.header.Get("X-Bidikv-Reuse"), "turn 2 reused D's blocks")
					}
					conv.hear(got.text)
				}
			})
		}
	}
}
