package kvroutetest_test

import (
	"bytes"
	"encoding/json"
	"io"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func postPath(t *testing.T, url, path string, body []byte) (int, []byte) {
	t.Helper()
	resp, err := http.Post(url+path, "application/json", bytes.NewReader(body))
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return resp.StatusCode, b
}

func TestRenderOptions(t *testing.T) {
	tests := []struct {
		name   string
		opts   []kvroutetest.Option
		status int
	}{
		{"default", nil, http.StatusOK},
		{"renderer off", []kvroutetest.Option{kvroutetest.WithRenderer(false)}, http.StatusNotImplemented},
		{"old engine", []kvroutetest.Option{kvroutetest.WithRenderRoutes(false)}, http.StatusNotFound},
		{"old engine wins over renderer on", []kvroutetest.Option{kvroutetest.WithRenderRoutes(false), kvroutetest.WithRenderer(true)}, http.StatusNotFound},
		{"routes back on", []kvroutetest.Option{kvroutetest.WithRenderRoutes(false), kvroutetest.WithRenderRoutes(true)}, http.StatusOK},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := kvroutetest.NewEngine(t, tt.opts...)
			status, b := postPath(t, e.URL(), "/v1/chat/completions/render", body(t, nil, 0))
			assert.Equal(t, tt.status, status, string(b))
			status, _ = postPath(t, e.URL(), "/tokenize", body(t, nil, 0))
			assert.Equal(t, http.StatusOK, status)
			st := e.Stats()
			if tt.status == http.StatusNotFound {
				assert.Zero(t, st.RenderRequests, "no route, nothing served")
			} else {
				assert.Equal(t, 1, st.RenderRequests)
			}
			assert.Equal(t, 1, st.TokenizeRequests)
			assert.Zero(t, st.Requests)
		})
	}
}

// Reference's token ids are what an engine returns with return_token_ids,
// and the render endpoint agrees with its prompt ids.
func TestReferenceTokenIDs(t *testing.T) {
	e := kvroutetest.NewEngine(t, kvroutetest.WithReasoning(true))
	var m map[string]any
	require.NoError(t, json.Unmarshal(body(t, nil, 0), &m))
	m["return_token_ids"] = true
	b, err := json.Marshal(m)
	require.NoError(t, err)
	ref, err := kvroutetest.Reference(chatPath, b, kvroutetest.WithReasoning(true))
	require.NoError(t, err)
	status, out := postPath(t, e.URL(), chatPath, b)
	require.Equal(t, http.StatusOK, status, string(out))
	var got struct {
		PromptTokenIDs []uint32 `json:"prompt_token_ids"`
		Choices        []struct {
			TokenIDs []uint32 `json:"token_ids"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(out, &got))
	assert.Equal(t, ref.PromptTokenIDs, got.PromptTokenIDs)
	assert.Equal(t, ref.TokenIDs, got.Choices[0].TokenIDs)
	assert.Len(t, ref.TokenIDs, ref.CompletionTokens)

	status, rb := postPath(t, e.URL(), "/v1/chat/completions/render", b)
	require.Equal(t, http.StatusOK, status)
	var gr struct {
		TokenIDs []uint32 `json:"token_ids"`
	}
	require.NoError(t, json.Unmarshal(rb, &gr))
	assert.Equal(t, ref.PromptTokenIDs, gr.TokenIDs)
}

// The template and reasoning options reach the engine and Reference alike.
func TestTemplateOptions(t *testing.T) {
	tests := []struct {
		name  string
		opts  []kvroutetest.Option
		check func(t *testing.T, msg map[string]json.RawMessage, ref kvroutetest.Answer)
	}{
		{"reasoning field default", []kvroutetest.Option{kvroutetest.WithReasoning(true)}, func(t *testing.T, m map[string]json.RawMessage, ref kvroutetest.Answer) {
			assert.Contains(t, m, "reasoning")
			assert.NotContains(t, m, "reasoning_content")
			assert.NotEmpty(t, ref.Reasoning)
		}},
		{"reasoning_content", []kvroutetest.Option{kvroutetest.WithReasoning(true), kvroutetest.WithReasoningField("reasoning_content")}, func(t *testing.T, m map[string]json.RawMessage, _ kvroutetest.Answer) {
			assert.Contains(t, m, "reasoning_content")
			assert.NotContains(t, m, "reasoning")
		}},
		{"no parser", []kvroutetest.Option{kvroutetest.WithReasoning(true), kvroutetest.WithReasoningParser(false)}, func(t *testing.T, m map[string]json.RawMessage, ref kvroutetest.Answer) {
			assert.Equal(t, "null", string(m["reasoning"]))
			assert.Contains(t, ref.Text, "<think>")
			assert.Empty(t, ref.Reasoning)
		}},
		{"llama3", []kvroutetest.Option{kvroutetest.WithTemplate("llama3")}, func(t *testing.T, _ map[string]json.RawMessage, ref kvroutetest.Answer) {
			assert.Equal(t, uint32(128000), ref.PromptTokenIDs[0], "<|begin_of_text|>")
		}},
		{"openai content format", []kvroutetest.Option{kvroutetest.WithContentFormat("openai")}, func(t *testing.T, _ map[string]json.RawMessage, ref kvroutetest.Answer) {
			assert.NotEmpty(t, ref.Text)
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			e := kvroutetest.NewEngine(t, tt.opts...)
			b := body(t, nil, 0)
			ref, err := kvroutetest.Reference(chatPath, b, tt.opts...)
			require.NoError(t, err)
			status, out := postPath(t, e.URL(), chatPath, b)
			require.Equal(t, http.StatusOK, status, string(out))
			var v struct {
				Choices []struct {
					Message map[string]json.RawMessage `json:"message"`
				} `json:"choices"`
			}
			require.NoError(t, json.Unmarshal(out, &v))
			m := v.Choices[0].Message
			var content string
			require.NoError(t, json.Unmarshal(m["content"], &content))
			assert.Equal(t, ref.Text, content)
			tt.check(t, m, ref)
		})
	}
	_, err := kvroutetest.StartEngine(kvroutetest.WithTemplate("nope"))
	assert.ErrorIs(t, err, kvroutetest.ErrInvalidConfig)
}

// With WithDriftRate(1) the reply's ids are not what its text tokenizes to
// (Reference agrees with the engine), which /tokenize shows.
func TestDriftOption(t *testing.T) {
	e := kvroutetest.NewEngine(t, kvroutetest.WithDriftRate(1))
	var m map[string]any
	require.NoError(t, json.Unmarshal(body(t, nil, 0), &m))
	m["return_token_ids"] = true
	b, err := json.Marshal(m)
	require.NoError(t, err)
	ref, err := kvroutetest.Reference(chatPath, b, kvroutetest.WithDriftRate(1))
	require.NoError(t, err)
	status, out := postPath(t, e.URL(), chatPath, b)
	require.Equal(t, http.StatusOK, status)
	var got struct {
		Choices []struct {
			Message  struct{ Content string } `json:"message"`
			TokenIDs []uint32                 `json:"token_ids"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(out, &got))
	assert.Equal(t, ref.TokenIDs, got.Choices[0].TokenIDs)
	assert.Equal(t, ref.Text, got.Choices[0].Message.Content)

	tb, err := json.Marshal(map[string]any{"prompt": ref.Text})
	require.NoError(t, err)
	status, tok := postPath(t, e.URL(), "/tokenize", tb)
	require.Equal(t, http.StatusOK, status)
	var tr struct {
		Tokens []uint32 `json:"tokens"`
	}
	require.NoError(t, json.Unmarshal(tok, &tr))
	gen := ref.TokenIDs[:len(ref.TokenIDs)-1] // without EOS
	assert.Len(t, tr.Tokens, len(gen)-1, "the split word re-tokenizes to one token")
	plain, err := kvroutetest.Reference(chatPath, b)
	require.NoError(t, err)
	assert.NotEqual(t, plain.TokenIDs, ref.TokenIDs)
}

// Handles carry one block list per KV group; a group cut below what the
// reader allocates kills the engine (500, AssertFailures, a new engine id).
func TestKVGroupsOption(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithKVGroups(2), kvroutetest.WithRecomputeThreshold(0))
	p, d := c.Prefill[0], c.Decode[0]
	miss := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
	rp := postJSON(t, d.URL(), body(t, miss, 1))
	require.Equal(t, http.StatusOK, rp.status)
	var h map[string]any
	require.NoError(t, json.Unmarshal(rp.kv, &h))
	groups := h["remote_block_ids"].([]any)
	require.Len(t, groups, 2)
	assert.Equal(t, len(groups[0].([]any)), len(groups[1].([]any)))
	groups[1] = []any{}
	h["remote_block_ids"] = groups
	old := p.EngineID()
	rd := postJSON(t, p.URL(), body(t, h, 0))
	assert.Equal(t, http.StatusInternalServerError, rd.status)
	st := p.Stats()
	assert.Equal(t, 1, st.AssertFailures)
	assert.Equal(t, 1, st.Restarts)
	assert.NotEqual(t, old, p.EngineID())
}
