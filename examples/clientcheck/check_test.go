package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// agentBody is an agent's request on path with a tool and tool_choice
// auto (the default with tools), streaming or not.
func agentBody(path, text string, stream bool) []byte {
	tool := map[string]any{"type": "function", "name": "shell", "parameters": map[string]any{"type": "object"}}
	m := map[string]any{"model": kvroutetest.DefaultModel, "stream": stream}
	switch path {
	case "/v1/chat/completions":
		m["messages"] = []any{map[string]any{"role": "user", "content": text}}
		m["tools"] = []any{map[string]any{"type": "function", "function": map[string]any{"name": "shell", "parameters": map[string]any{"type": "object"}}}}
		m["max_tokens"] = 300
	case "/v1/completions":
		m["prompt"] = text
		m["max_tokens"] = 20
	case "/v1/responses":
		m["input"] = []any{map[string]any{"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": text}}}}
		m["tools"] = []any{tool}
		m["max_output_tokens"] = 300
	case "/v1/messages":
		m["messages"] = []any{map[string]any{"role": "user", "content": text}}
		m["tools"] = []any{map[string]any{"name": "shell", "input_schema": map[string]any{"type": "object"}}}
		m["max_tokens"] = 300
	}
	b, _ := json.Marshal(m)
	return b
}

// answerOf reads the same reply from a body and from a stream, and it
// is the single engine's (text and tool calls) for every API, calls or
// not.
func TestAnswerOf(t *testing.T) {
	e := kvroutetest.NewEngine(t)
	calls := 0
	for _, path := range []string{"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"} {
		for i := range 8 {
			text := fmt.Sprintf("Question %d: list the files.", i)
			ref, err := kvroutetest.Reference(path, agentBody(path, text, false))
			require.NoError(t, err)
			var got [2]reply
			for j, stream := range []bool{false, true} {
				resp, err := http.Post(e.URL()+path, "application/json", bytes.NewReader(agentBody(path, text, stream)))
				require.NoError(t, err)
				b, err := io.ReadAll(resp.Body)
				require.NoError(t, err)
				_ = resp.Body.Close()
				require.Equal(t, http.StatusOK, resp.StatusCode, "%s", b)
				got[j] = answerOf(path, b)
			}
			assert.Equal(t, got[0], got[1], "%s %d: a body and a stream", path, i)
			assert.Equal(t, ref.Text, got[0].text, "%s %d", path, i)
			assert.Equal(t, len(ref.ToolCalls), strings.Count(got[0].calls, ";"), "%s %d: %s", path, i, got[0].calls)
			assert.NotEmpty(t, got[0].end)
			calls += len(ref.ToolCalls)
		}
	}
	assert.Positive(t, calls, "some replies call the tool")
}

// The checker passes a client's requests on and tells an answer that is
// the plain engine's from one that is not.
func TestChecker(t *testing.T) {
	same, plain := kvroutetest.NewEngine(t), kvroutetest.NewEngine(t)
	other := kvroutetest.NewEngine(t, kvroutetest.WithDriftRate(1)) // other token splits, other answers
	for _, tc := range []struct {
		name  string
		proxy string
		equal bool
	}{{"the same answers", same.URL(), true}, {"other answers", other.URL(), false}} {
		t.Run(tc.name, func(t *testing.T) {
			var out bytes.Buffer
			c, err := newChecker(tc.proxy, plain.URL(), &out)
			require.NoError(t, err)
			srv := httptest.NewServer(c)
			defer srv.Close()
			for _, path := range []string{"/v1/chat/completions", "/v1/responses", "/v1/messages"} {
				resp, err := http.Post(srv.URL+path, "application/json", bytes.NewReader(agentBody(path, "Say hello and list the files twice.", true)))
				require.NoError(t, err)
				_, _ = io.Copy(io.Discard, resp.Body)
				_ = resp.Body.Close()
				assert.Equal(t, http.StatusOK, resp.StatusCode)
			}
			resp, err := http.Get(srv.URL + "/v1/models") // passed on, not checked
			require.NoError(t, err)
			_ = resp.Body.Close()
			assert.Equal(t, http.StatusOK, resp.StatusCode)
			if tc.equal {
				assert.EqualValues(t, 3, c.equal.Load(), out.String())
				assert.Zero(t, c.differ.Load())
			} else {
				assert.Positive(t, c.differ.Load(), out.String())
			}
			assert.EqualValues(t, 3, c.n.Load())
			assert.Contains(t, out.String(), "request=1 path=/v1/chat/completions input=user_text status=200")
		})
	}
}
