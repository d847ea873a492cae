package sim_test

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/internal/sim"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// node is an engine under test with its HTTP server.
type node struct {
	*sim.Engine
	url string
}

// vclock is a virtual clock for the tests.
type vclock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *vclock { return &vclock{now: time.Unix(1_700_000_000, 0)} }

func (c *vclock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *vclock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.now = c.now.Add(d)
}

func start(t *testing.T, reg *sim.Registry, clk sim.Clock, mod func(*sim.Config)) *node {
	t.Helper()
	cfg := sim.DefaultConfig()
	cfg.Registry, cfg.Clock = reg, clk
	if mod != nil {
		mod(&cfg)
	}
	e, err := sim.New(cfg)
	require.NoError(t, err)
	srv := httptest.NewServer(e)
	t.Cleanup(func() { srv.Close(); e.Close() })
	return &node{Engine: e, url: srv.URL}
}

type result struct {
	Status int
	Body   []byte
	// parsed non-streaming body
	Text     string
	Finish   string
	Prompt   int
	Complete int
	KV       json.RawMessage
	TokenIDs []int // choice 0's, with return_token_ids (fetch only)
}

func post(t *testing.T, url, path string, body any) result {
	t.Helper()
	return postCtx(t, context.Background(), url, path, body)
}

func postCtx(t *testing.T, ctx context.Context, url, path string, body any) result {
	t.Helper()
	raw, ok := body.([]byte)
	if !ok {
		var err error
		raw, err = json.Marshal(body)
		require.NoError(t, err)
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+path, bytes.NewReader(raw))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return result{Status: -1}
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	res := result{Status: resp.StatusCode, Body: b}
	if resp.StatusCode != http.StatusOK || bytes.HasPrefix(b, []byte("data:")) {
		return res
	}
	var parsed struct {
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			PromptTokens     int `json:"prompt_tokens"`
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	require.NoError(t, json.Unmarshal(b, &parsed), string(b))
	require.NotEmpty(t, parsed.Choices)
	res.Text = parsed.Choices[0].Message.Content + parsed.Choices[0].Text
	res.Finish = parsed.Choices[0].FinishReason
	res.Prompt, res.Complete = parsed.Usage.PromptTokens, parsed.Usage.CompletionTokens
	if string(parsed.KV) != "null" {
		res.KV = parsed.KV
	}
	return res
}

type msg struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

func chat(msgs ...msg) map[string]any {
	return map[string]any{"model": "sim-model", "messages": msgs}
}

func with(body map[string]any, kv ...any) map[string]any {
	out := map[string]any{}
	for k, v := range body {
		out[k] = v
	}
	for i := 0; i+1 < len(kv); i += 2 {
		out[kv[i].(string)] = kv[i+1]
	}
	return out
}

// missHandle is message 1 of docs/kvroute.md's Wire protocol.
func missHandle() map[string]any {
	return map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
}

// asP turns a stored D handle into message 2 of the kvroute Wire protocol.
func asP(t *testing.T, h json.RawMessage) map[string]any {
	t.Helper()
	var m map[string]any
	require.NoError(t, json.Unmarshal(h, &m))
	m["do_remote_decode"], m["do_remote_prefill"] = true, false
	return m
}

func reference(t *testing.T, path string, body any) sim.Generated {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	req, err := sim.ParseRequest(path, raw)
	require.NoError(t, err)
	toks := make([]uint32, len(req.Prompt))
	for i, tk := range req.Prompt {
		toks[i] = tk.ID
	}
	return sim.Reference("sim-model", toks, sim.GenParams{MaxTokens: req.MaxTokens, Stop: req.Stop})
}

// words returns a user message of about n tokens.
func words(prefix string, n int) string {
	var b bytes.Buffer
	b.WriteString(prefix)
	for i := 0; i < n; i++ {
		b.WriteString(" w")
		b.WriteByte(byte('a' + i%26))
	}
	return b.String()
}
