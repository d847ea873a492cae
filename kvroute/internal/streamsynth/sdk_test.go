package streamsynth_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
)

// clientsDir is examples/clients: synth.mjs and the pinned SDKs.
const clientsDir = "../../../examples/clients"

// needNode returns the node binary, skipping the test when node (20 or
// later) or the SDKs (npm ci --prefix examples/clients) are missing,
// except in CI (CI=true), where it fails.
func needNode(t *testing.T) string {
	t.Helper()
	missing := func(format string, args ...any) string {
		if os.Getenv("CI") == "true" {
			t.Fatalf(format, args...)
		}
		t.Skipf(format, args...)
		return ""
	}
	node, err := exec.LookPath("node")
	if err != nil {
		return missing("node not installed: %v", err)
	}
	out, err := exec.Command(node, "--version").Output()
	if err != nil {
		return missing("node --version: %v", err)
	}
	major := 0
	if m := regexp.MustCompile(`^v(\d+)\.`).FindSubmatch(out); m != nil {
		major, _ = strconv.Atoi(string(m[1]))
	}
	if major < 20 {
		return missing("node %s is older than 20", bytes.TrimSpace(out))
	}
	for _, pkg := range []string{"openai", "@anthropic-ai/sdk"} {
		if _, err := os.Stat(filepath.Join(clientsDir, "node_modules", pkg, "package.json")); err != nil {
			return missing("%s not installed (npm ci --prefix examples/clients): %v", pkg, err)
		}
	}
	return node
}

// sdkCase is one answer the SDKs ask for, with and without streaming.
type sdkCase struct {
	ID           int    `json:"id"`
	Name         string `json:"name"`
	API          string `json:"api"` // chat, completions, messages
	IncludeUsage bool   `json:"includeUsage"`
	body         []byte
	api          streamsynth.API
}

// sdkServer answers /case/{id}/v1/... with the case's body, as JSON to a
// request without "stream" and as the synthesized stream, with the
// request's stream_options, to one with it; /cases lists the cases.
type sdkServer struct {
	cases []sdkCase
	mu    sync.Mutex
	seen  map[string]int // "id stream|json" → requests
	errs  []string
}

func (s *sdkServer) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path == "/cases" {
		_ = json.NewEncoder(w).Encode(s.cases)
		return
	}
	var id int
	var rest string
	if _, err := fmt.Sscanf(r.URL.Path, "/case/%d/%s", &id, &rest); err != nil || id < 0 || id >= len(s.cases) {
		http.NotFound(w, r)
		return
	}
	c := s.cases[id]
	if "/"+rest != c.api.String() || r.Method != http.MethodPost {
		s.fail("case %d: %s %s", id, r.Method, r.URL.Path)
		http.NotFound(w, r)
		return
	}
	var req struct {
		Stream        bool `json:"stream"`
		StreamOptions *struct {
			IncludeUsage bool `json:"include_usage"`
		} `json:"stream_options"`
	}
	b, _ := io.ReadAll(r.Body)
	if err := json.Unmarshal(b, &req); err != nil {
		s.fail("case %d: request %q: %v", id, b, err)
	}
	s.mu.Lock()
	s.seen[fmt.Sprint(id, " ", req.Stream)]++
	s.mu.Unlock()
	if !req.Stream {
		w.Header().Set("Content-Type", "application/json")
		_, _ = w.Write(c.body)
		return
	}
	opt := streamsynth.Options{}
	if req.StreamOptions != nil {
		opt.IncludeUsage = req.StreamOptions.IncludeUsage
	}
	if c.api != streamsynth.Messages && opt.IncludeUsage != c.IncludeUsage {
		s.fail("case %d: include_usage %v, want %v", id, opt.IncludeUsage, c.IncludeUsage)
	}
	streamsynth.SetHeader(w.Header())
	if err := c.api.Write(w, c.body, opt); err != nil {
		s.fail("case %d: %v", id, err)
	}
}

func (s *sdkServer) fail(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.errs = append(s.errs, fmt.Sprintf(format, args...))
}

// The official OpenAI and Anthropic SDKs, unmodified, parse every
// synthesized stream of the table tests (every chat case with usage off
// and on but the one without choices, every completions and Messages
// case) through their stream
// helpers (chat.completions.stream().finalChatCompletion(),
// messages.stream() and beta.messages.stream(), Claude Code's, with
// finalMessage() and tool_use input parsed) and by
// iterating create({stream: true}), and each reassembled answer equals
// the SDK's parse of the non-streaming body (examples/clients/synth.mjs).
func TestOfficialSDKs(t *testing.T) {
	if testing.Short() {
		t.Skip("runs node")
	}
	node := needNode(t)
	srv := &sdkServer{seen: map[string]int{}}
	add := func(name string, api streamsynth.API, body string, usage bool) {
		kind := map[streamsynth.API]string{streamsynth.ChatCompletions: "chat", streamsynth.Completions: "completions", streamsynth.Messages: "messages"}[api]
		srv.cases = append(srv.cases, sdkCase{ID: len(srv.cases), Name: name, API: kind, IncludeUsage: usage, body: []byte(body), api: api})
	}
	for _, c := range chatCases {
		if c.name == "no choices" {
			// vLLM never answers without a choice, and the OpenAI SDK's
			// stream helper rejects a stream without one, whoever sent it.
			continue
		}
		add(c.name, streamsynth.ChatCompletions, c.body, false)
		add(c.name+", usage", streamsynth.ChatCompletions, c.body, true)
	}
	for _, c := range completionCases {
		add(c.name, streamsynth.Completions, c.body, true)
	}
	for _, c := range messagesCases {
		add(c.name, streamsynth.Messages, c.body, false)
	}
	hs := httptest.NewServer(srv) // 127.0.0.1
	defer hs.Close()

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, node, "synth.mjs", hs.URL, "--json")
	cmd.Dir = clientsDir
	for _, kv := range os.Environ() { // the SDKs get their keys and URLs from synth.mjs only
		if !strings.HasPrefix(kv, "OPENAI_") && !strings.HasPrefix(kv, "ANTHROPIC_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	runErr := cmd.Run()
	var rep struct {
		Versions struct{ OpenAI, Anthropic, Node string }
		Failed   int
		Rows     []struct {
			Name, API string
			Checks    int
			Failures  []string
		}
	}
	require.NoError(t, json.Unmarshal(stdout.Bytes(), &rep), "synth.mjs: %v\nstdout:\n%s\nstderr:\n%s", runErr, stdout.String(), stderr.String())
	require.Len(t, rep.Rows, len(srv.cases))
	for _, r := range rep.Rows {
		assert.Empty(t, r.Failures, "%s %s", r.API, r.Name)
		want := map[string]int{"chat": 2, "completions": 1, "messages": 5}[r.API]
		assert.Equal(t, want, r.Checks, "%s %s: every check ran", r.API, r.Name)
	}
	assert.Zero(t, rep.Failed)
	assert.NoError(t, runErr, stderr.String())
	assert.Empty(t, srv.errs)
	for _, c := range srv.cases {
		streams := map[string]int{"chat": 2, "completions": 1, "messages": 3}[c.API]
		assert.Equal(t, streams, srv.seen[fmt.Sprint(c.ID, " true")], "case %d %s: streamed requests", c.ID, c.Name)
		assert.Equal(t, 1, srv.seen[fmt.Sprint(c.ID, " false")], "case %d %s: plain requests", c.ID, c.Name)
	}
	t.Logf("openai %s, @anthropic-ai/sdk %s, node %s: %d cases", rep.Versions.OpenAI, rep.Versions.Anthropic, rep.Versions.Node, len(rep.Rows))
}
