package kvroute_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"iter"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// leakGuard wraps a handler and fails the test if any byte a client
// receives contains kv_transfer_params.
type leakGuard struct {
	t testing.TB
	h http.Handler
}

func (g leakGuard) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	g.h.ServeHTTP(&guardWriter{ResponseWriter: w, t: g.t}, r)
}

type guardWriter struct {
	http.ResponseWriter
	t    testing.TB
	tail []byte // the last bytes written, to catch a key split across writes
}

func (w *guardWriter) Write(b []byte) (int, error) {
	joined := append(append([]byte(nil), w.tail...), b...)
	if bytes.Contains(joined, []byte("kv_transfer_params")) {
		w.t.Errorf("a client received kv_transfer_params: %.300s", b)
	}
	if len(joined) > 32 {
		joined = joined[len(joined)-32:]
	}
	w.tail = joined
	return w.ResponseWriter.Write(b)
}

func (w *guardWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// serve starts the router behind a leak guard on 127.0.0.1.
func serve(t testing.TB, r *kvroute.Router) string {
	t.Helper()
	srv := httptest.NewServer(leakGuard{t: t, h: r})
	t.Cleanup(srv.Close)
	return srv.URL
}

// newServer starts h on 127.0.0.1 and returns its URL.
func newServer(t testing.TB, h http.Handler) string {
	srv := httptest.NewServer(h)
	t.Cleanup(srv.Close)
	return srv.URL
}

// newRouter builds a router over a cluster's engines.
func newRouter(t testing.TB, c *kvroutetest.Cluster, opts ...kvroute.Option) *kvroute.Router {
	t.Helper()
	var base []kvroute.Option
	for _, e := range c.Prefill {
		base = append(base, kvroute.WithPrefill(e.URL()))
	}
	for _, e := range c.Decode {
		base = append(base, kvroute.WithDecode(e.URL()))
	}
	if c.Clock != nil {
		base = append(base, kvroute.WithClock(c.Clock.Now))
	}
	r, err := kvroute.New(append(base, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	return r
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// conversation is a client that resends its whole history every turn.
type conversation struct {
	path     string // kvroute.PathChatCompletions or PathCompletions
	stream   bool
	maxTok   int
	messages []message
	prompt   string
	extra    map[string]any
	header   http.Header
}

func (c *conversation) body() []byte {
	m := map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": c.maxTok, "stream": c.stream}
	if c.path == kvroute.PathChatCompletions {
		m["messages"] = c.messages
	} else {
		m["prompt"] = c.prompt
	}
	for k, v := range c.extra {
		m[k] = v
	}
	b, err := json.Marshal(m)
	if err != nil {
		panic(err)
	}
	return b
}

// say appends the user's next input.
func (c *conversation) say(text string) {
	if c.path == kvroute.PathChatCompletions {
		c.messages = append(c.messages, message{Role: "user", Content: text})
	} else {
		c.prompt += "\nUser: " + text + "\nAssistant:"
	}
}

// hear appends the reply as the benchmark client does.
func (c *conversation) hear(reply string) {
	if c.path == kvroute.PathChatCompletions {
		c.messages = append(c.messages, message{Role: "assistant", Content: reply})
	} else {
		c.prompt += reply
	}
}

type turnResult struct {
	status int
	header http.Header
	text   string
	finish string
	raw    []byte
}

// send posts body to the router and reads the whole response.
func send(t testing.TB, url, path string, body []byte, header http.Header) turnResult {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+path, bytes.NewReader(body))
	require.NoError(t, err)
	for k, v := range header {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	return turnResult{status: resp.StatusCode, header: resp.Header, raw: raw}
}

func (r turnResult) streamed() bool {
	return strings.HasPrefix(r.header.Get("Content-Type"), "text/event-stream")
}

// post sends body to the router and reads the reply text.
func post(t testing.TB, url, path string, body []byte, header http.Header) turnResult {
	t.Helper()
	res := send(t, url, path, body, header)
	if res.status != http.StatusOK {
		return res
	}
	if res.streamed() {
		res.text, res.finish = parseStream(t, res.raw)
	} else {
		res.text, res.finish = parseBody(t, res.raw)
	}
	return res
}

type choice struct {
	Text    string `json:"text"`
	Message struct {
		Content string `json:"content"`
	} `json:"message"`
	Delta struct {
		Content string `json:"content"`
	} `json:"delta"`
	FinishReason *string `json:"finish_reason"`
}

func parseBody(t testing.TB, raw []byte) (string, string) {
	var b struct{ Choices []choice }
	require.NoError(t, json.Unmarshal(raw, &b), "%s", raw)
	require.NotEmpty(t, b.Choices)
	c := b.Choices[0]
	fin := ""
	if c.FinishReason != nil {
		fin = *c.FinishReason
	}
	return c.Message.Content + c.Text, fin
}

// streamScan is what a client read from an SSE stream.
type streamScan struct {
	text, finish string
	done         bool   // data: [DONE] arrived
	errData      string // the first error event's data, "" when none
}

// sseData yields the payload of each "data: " line of an SSE stream.
func sseData(raw []byte) iter.Seq[string] {
	return func(yield func(string) bool) {
		sc := bufio.NewScanner(bytes.NewReader(raw))
		sc.Buffer(make([]byte, 1<<20), 1<<24)
		for sc.Scan() {
			if data, ok := strings.CutPrefix(sc.Text(), "data: "); ok && !yield(data) {
				return
			}
		}
	}
}

func scanStream(t testing.TB, raw []byte) streamScan {
	var s streamScan
	var text strings.Builder
	for data := range sseData(raw) {
		if data == "[DONE]" {
			s.done = true
			continue
		}
		var ch struct {
			Choices []choice
			Error   json.RawMessage
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ch), "%s", data)
		if ch.Error != nil && s.errData == "" {
			s.errData = data
		}
		for _, c := range ch.Choices {
			text.WriteString(c.Delta.Content + c.Text)
			if c.FinishReason != nil {
				s.finish = *c.FinishReason
			}
		}
	}
	s.text = text.String()
	return s
}

// parseStream reads a stream that must have completed without error.
func parseStream(t testing.TB, raw []byte) (string, string) {
	s := scanStream(t, raw)
	require.Empty(t, s.errData, "stream error")
	require.True(t, s.done, "stream ended without [DONE]")
	return s.text, s.finish
}

// reference is the single-engine answer for body.
func reference(t testing.TB, path string, body []byte, opts ...kvroutetest.Option) string {
	t.Helper()
	a, err := kvroutetest.Reference(path, body, opts...)
	require.NoError(t, err)
	return a.Text
}

// prefillRecords returns the prefill-role requests an engine served.
func roleRecords(e *kvroutetest.Engine, role string) []kvroutetest.RequestRecord {
	var out []kvroutetest.RequestRecord
	for _, r := range e.Requests() {
		if r.Role == role {
			out = append(out, r)
		}
	}
	return out
}

// systemPrompt is long enough (over 64 tokens) for the first turn's KV to
// be worth a pull.
const systemPrompt = "You are a coding agent working in a large Go repository. You can list files, read them, run the tests and edit code. " +
	"Think about the failing tests before you change anything, keep changes small, explain each step in one sentence, " +
	"and never invent file names: list the directory first. When the tests pass, summarise what you changed and why."

func userText(i int) string {
	return fmt.Sprintf("Turn %d: please look at the tool output below and continue the plan. The file has %d lines and the test suite reports %d failures in module m%d.", i, 100+i*7, i%5, i)
}
