package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// tenantConv is one conversation on one API, resending its history as
// the official clients do.
type tenantConv struct {
	path   string
	stream bool
	agent  *agentClient // Responses and Messages
	msgs   []map[string]string
	prompt string
}

func newTenantConv(path string, stream bool) *tenantConv {
	c := &tenantConv{path: path, stream: stream}
	switch path {
	case "/v1/responses":
		c.agent = &agentClient{path: path, stream: stream, base: codexBody("")}
		delete(c.agent.base, "prompt_cache_key") // found by content, not by a hint
	case "/v1/messages":
		c.agent = &agentClient{path: path, stream: stream, base: claudeBody("")}
	case "/v1/chat/completions":
		c.msgs = []map[string]string{{"role": "system", "content": agentSystem}}
	case "/v1/completions":
		c.prompt = agentSystem
	}
	return c
}

func (c *tenantConv) ask(text string) {
	switch {
	case c.agent != nil:
		c.agent.ask(text)
	case c.path == "/v1/chat/completions":
		c.msgs = append(c.msgs, map[string]string{"role": "user", "content": text})
	default:
		c.prompt += "\nUser: " + text + "\nAssistant:"
	}
}

func (c *tenantConv) body() []byte {
	if c.agent != nil {
		return c.agent.body()
	}
	m := map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": 12, "stream": c.stream}
	if c.path == "/v1/chat/completions" {
		m["messages"] = c.msgs
	} else {
		m["prompt"] = c.prompt
	}
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

// header is what the API's official client sends besides its key.
func (c *tenantConv) header() http.Header {
	if c.agent != nil {
		return c.agent.header(0)
	}
	h := http.Header{"Content-Type": {"application/json"}, "User-Agent": {"OpenAI/Python 1.99.0"},
		"X-Stainless-Lang": {"python"}}
	return h
}

// send posts the conversation with the credential headers cred (pairs,
// names as sent) and returns the status, X-Bidikv-Reuse and the answer's
// text; a 200 answer is appended to the history.
func (c *tenantConv) send(t *testing.T, client *http.Client, base string, cred []string) (int, string, string) {
	t.Helper()
	body := c.body()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+c.path, bytes.NewReader(body))
	require.NoError(t, err)
	req.Header = c.header()
	req.Header["Cookie"] = []string{"session=browser-secret"}
	req.Header["Proxy-Authorization"] = []string{"Basic cHJveHk6c2VjcmV0"}
	for i := 0; i+1 < len(cred); i += 2 {
		req.Header[cred[i]] = append(req.Header[cred[i]], cred[i+1])
	}
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	reuse := resp.Header.Get("X-Bidikv-Reuse")
	if resp.StatusCode != http.StatusOK {
		return resp.StatusCode, reuse, string(b)
	}
	return resp.StatusCode, reuse, c.heard(t, b)
}

// heard checks a 200 answer (no handle member), appends it to the history
// and returns its text.
func (c *tenantConv) heard(t *testing.T, b []byte) string {
	t.Helper()
	for _, s := range []string{"kv_transfer_params", "remote_block_ids"} {
		require.NotContains(t, string(b), s)
	}
	if c.agent != nil {
		var out agentTurn
		if c.stream {
			c.agent.readStream(t, b, &out)
		} else {
			c.agent.readBody(t, b, &out)
		}
		c.agent.items = append(c.agent.items, out.echo...)
		return out.text
	}
	text := openAIText(t, b, c.stream)
	if c.path == "/v1/chat/completions" {
		c.msgs = append(c.msgs, map[string]string{"role": "assistant", "content": text})
	} else {
		c.prompt += text
	}
	return text
}

// openAIText is choice 0's text of a chat or completions answer.
func openAIText(t *testing.T, b []byte, stream bool) string {
	t.Helper()
	type choice struct {
		Text    string
		Message struct{ Content string }
		Delta   struct{ Content string }
	}
	if !stream {
		var r struct{ Choices []choice }
		require.NoError(t, json.Unmarshal(b, &r), "%s", b)
		require.NotEmpty(t, r.Choices)
		return r.Choices[0].Message.Content + r.Choices[0].Text
	}
	var sb strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var r struct{ Choices []choice }
		require.NoError(t, json.Unmarshal([]byte(data), &r), "%s", data)
		for _, ch := range r.Choices {
			sb.WriteString(ch.Delta.Content + ch.Text)
		}
	}
	return sb.String()
}

// Tenant isolation under attack, through the proxy: tenant B (its own
// accepted key) resends tenant A's exact history on every API, streaming
// and not, with B's key spelled every way a client can (either header,
// any scheme case, extra spaces, duplicates, empty values, a second
// credential); B never reuses A's KV (X-Bidikv-Reuse never "hit": no pull
// of A's blocks, no spent handle, nothing learnt from the header or the
// TTFT), and a request naming two different keys is refused. A's own key
// by either header is A's tenant: A's next turn hits. No credential the
// client sent reaches an engine.
func TestTenantIsolation(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	p := startInProcess(t, nil, "--api-key", "sk-tenant-a", "--api-key", "sk-tenant-b",
		"--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL())
	client := &http.Client{Transport: &http.Transport{}}
	t.Cleanup(client.CloseIdleConnections)

	const keyA, keyB = "sk-tenant-a", "sk-tenant-b"
	// B's spellings, and whether the proxy admits them (as B).
	attacks := []struct {
		name  string
		cred  []string
		admit bool
	}{
		{"bearer", []string{"Authorization", "Bearer " + keyB}, true},
		{"lowercase bearer", []string{"authorization", "bearer " + keyB}, true},
		{"uppercase scheme, extra spaces", []string{"Authorization", "  BEARER   " + keyB + "  "}, true},
		{"bearer, tab", []string{"Authorization", "Bearer\t" + keyB}, true},
		{"x-api-key", []string{"X-Api-Key", keyB}, true},
		{"lowercase x-api-key, spaces", []string{"x-api-key", "  " + keyB + " "}, true},
		{"both headers, b", []string{"Authorization", "Bearer " + keyB, "X-Api-Key", keyB}, true},
		{"empty x-api-key beside bearer", []string{"X-Api-Key", "", "Authorization", "Bearer " + keyB}, true},
		{"bearer without token beside x-api-key", []string{"Authorization", "Bearer", "X-Api-Key", keyB}, true},
		{"basic scheme beside x-api-key", []string{"Authorization", "Basic dXNlcjpwYXNz", "X-Api-Key", keyB}, true},
		{"duplicate x-api-key, b twice", []string{"X-Api-Key", keyB, "X-Api-Key", keyB}, true},
		{"b's bearer with a's x-api-key", []string{"Authorization", "Bearer " + keyB, "X-Api-Key", keyA}, false},
		{"a's bearer with b's x-api-key", []string{"Authorization", "Bearer " + keyA, "X-Api-Key", keyB}, false},
		{"duplicate x-api-key, b and a", []string{"X-Api-Key", keyB, "X-Api-Key", keyA}, false},
		{"duplicate authorization, b and a", []string{"Authorization", "Bearer " + keyB, "Authorization", "Bearer " + keyA}, false},
		{"unknown key beside a's", []string{"X-Api-Key", "sk-guess", "Authorization", "Bearer " + keyA}, false},
		{"no key", nil, false},
		{"empty values only", []string{"X-Api-Key", "", "Authorization", "Bearer  "}, false},
	}
	// A's second turn, by rotation: the same key, any header or spelling.
	aSpellings := [][]string{
		{"X-Api-Key", keyA},
		{"Authorization", "bearer " + keyA},
		{"Authorization", "Bearer " + keyA, "X-Api-Key", keyA},
		{"x-api-key", " " + keyA + " "},
		{"Authorization", "BEARER\t" + keyA},
	}
	apis := []struct {
		path   string
		stream bool
		first  []string // the official client's header for A's first turn
		hits   bool
	}{
		{"/v1/chat/completions", false, []string{"Authorization", "Bearer " + keyA}, true},
		{"/v1/chat/completions", true, []string{"Authorization", "Bearer " + keyA}, true},
		{"/v1/completions", false, []string{"Authorization", "Bearer " + keyA}, true},
		{"/v1/completions", true, []string{"Authorization", "Bearer " + keyA}, true},
		{"/v1/responses", false, []string{"Authorization", "Bearer " + keyA}, true},
		{"/v1/responses", true, []string{"Authorization", "Bearer " + keyA}, true},
		{"/v1/messages", false, []string{"X-Api-Key", keyA}, true},
		{"/v1/messages", true, []string{"X-Api-Key", keyA}, false}, // vLLM's Messages streams carry no handle
	}
	crossings, hitsA, n := 0, 0, 0
	for _, api := range apis {
		for i, atk := range attacks {
			n++
			name := fmt.Sprintf("%s stream=%v/%s", api.path, api.stream, atk.name)
			c := newTenantConv(api.path, api.stream)
			c.ask(agentAsk(name, 0))
			status, reuse, text := c.send(t, client, p.url, api.first)
			require.Equal(t, http.StatusOK, status, "%s: a's first turn: %s", name, text)
			require.Equal(t, "miss", reuse, name)
			c.ask(agentAsk(name, 1))
			history := c.body()

			// B resends A's exact history.
			b := *c
			if c.agent != nil {
				ag := *c.agent
				b.agent = &ag
			}
			status, reuse, text = b.send(t, client, p.url, atk.cred)
			if reuse == "hit" {
				crossings++
			}
			if !atk.admit {
				assert.Equal(t, http.StatusUnauthorized, status, "%s: %s", name, text)
				assert.Empty(t, reuse, name)
			} else if assert.Equal(t, http.StatusOK, status, "%s: %s", name, text) {
				assert.Equal(t, "miss", reuse, "%s: b never reuses a's KV", name)
				ref, err := kvroutetest.Reference(api.path, history)
				require.NoError(t, err)
				assert.Equal(t, ref.Text, text, name)
			}

			// A goes on, by another spelling of its own key.
			require.Equal(t, history, c.body())
			status, reuse, text = c.send(t, client, p.url, aSpellings[i%len(aSpellings)])
			require.Equal(t, http.StatusOK, status, "%s: %s", name, text)
			ref, err := kvroutetest.Reference(api.path, history)
			require.NoError(t, err)
			assert.Equal(t, ref.Text, text, name)
			if api.hits {
				assert.Equal(t, "hit", reuse, "%s: a's own key by any header is a's tenant", name)
			}
			if reuse == "hit" {
				hitsA++
			}
		}
	}
	assert.Zero(t, crossings, "tenant crossings")
	t.Logf("%d conversations: %d tenant crossings, %d of a's second turns hit", n, crossings, hitsA)
	for _, e := range append(cl.Prefill, cl.Decode...) {
		for _, rec := range e.Requests() {
			for _, h := range []string{"Authorization", "X-Api-Key", "Cookie", "Proxy-Authorization"} {
				require.Empty(t, rec.Header.Values(h), "%s never reaches an engine (%s %s)", h, rec.Role, rec.Path)
			}
		}
	}
}
