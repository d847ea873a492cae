package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// childEnv makes the test binary run bench's main instead of the tests
// (the exit status tests), so they need no separate build.
const childEnv = "BENCH_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		args := os.Args[1:]
		for i, a := range args {
			if a == "--" {
				args = args[i+1:]
				break
			}
		}
		os.Args = append([]string{"bench"}, args...)
		main()
		os.Exit(0)
	}
	goleak.VerifyTestMain(m)
}

// sessionRecorder records the X-Session-ID and X-Test headers it sees.
type sessionRecorder struct {
	h        http.Handler
	mu       sync.Mutex
	sessions map[string]int
	extra    int
}

func (s *sessionRecorder) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	s.mu.Lock()
	s.sessions[r.Header.Get("X-Session-ID")]++
	if r.Header.Get("X-Test") == "yes" {
		s.extra++
	}
	s.mu.Unlock()
	s.h.ServeHTTP(w, r)
}

func TestBenchAgainstRouter(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(c.Decode[0].URL()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	rec := &sessionRecorder{h: r, sessions: map[string]int{}}
	srv := httptest.NewServer(rec)
	t.Cleanup(srv.Close)

	sys := strings.Repeat("You are a careful assistant who answers briefly. ", 8)
	var convs []map[string]any
	for _, id := range []string{"a", "b", "c"} {
		convs = append(convs, map[string]any{"id": id, "messages": []map[string]string{
			{"role": "system", "content": sys},
			{"role": "user", "content": "First question of " + id},
			{"role": "assistant", "content": "stored answer, replaced by the live reply"},
			{"role": "user", "content": "Second question"},
			{"role": "assistant", "content": "x"},
			{"role": "user", "content": "Third question"},
		}})
	}
	dir := t.TempDir()
	in := filepath.Join(dir, "conv.json")
	raw, err := json.Marshal(convs)
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(in, raw, 0o644))
	out := filepath.Join(dir, "stats.json")

	var stdout bytes.Buffer
	err = runMain(context.Background(), []string{"--url", srv.URL, "--input", in, "--clients", "2", "--max-active", "2",
		"--max-tokens", "12", "--send-conversation-id", "--header", "X-Test: yes", "--output", out}, &stdout, io.Discard)
	require.NoError(t, err)
	t.Cleanup(func() { http.DefaultTransport.(*http.Transport).CloseIdleConnections() })

	var recs []record
	raw, err = os.ReadFile(out)
	require.NoError(t, err)
	require.NoError(t, json.Unmarshal(raw, &recs))
	require.Len(t, recs, 9)
	hits := 0
	for _, r := range recs {
		assert.Empty(t, r.Error)
		assert.Equal(t, http.StatusOK, r.Status)
		assert.Positive(t, r.TTFTMs)
		assert.GreaterOrEqual(t, r.LatencyMs, r.TTFTMs)
		if r.Reuse == string(kvroute.ReuseHit) {
			hits++
			assert.Positive(t, r.Turn, "the first turn cannot hit")
		}
	}
	// Every turn after the first continues the live reply and should hit.
	// The router retains D's handle only after the client has read
	// data: [DONE], so a client as fast as this one occasionally sends the
	// next turn first and misses; allow that, but no more than one in three.
	assert.GreaterOrEqual(t, hits, 4, "%+v", recs)
	assert.Equal(t, map[string]int{"a": 3, "b": 3, "c": 3}, rec.sessions)
	assert.Equal(t, 9, rec.extra)
	assert.Contains(t, stdout.String(), "reuse (X-Bidikv-Reuse): hit ")
	assert.Zero(t, c.Decode[0].Stats().WrongOutputs)
}

func TestGenerateConfig(t *testing.T) {
	cfg := `{"filetype": "generate_conversations", "num_conversations": 20, "text_files": ["missing.txt"],
	  "prompt_input": {"num_turns": {"distribution": "uniform", "min": 4, "max": 8},
	    "common_prefix_num_tokens": {"distribution": "constant", "value": 50},
	    "prefix_num_tokens": {"distribution": "lognormal", "average": 100, "max": 300},
	    "num_tokens": {"distribution": "uniform", "min": 10, "max": 20}},
	  "prompt_output": {"num_tokens": {"distribution": "constant", "value": 7}}}`
	path := filepath.Join(t.TempDir(), "gen.json")
	require.NoError(t, os.WriteFile(path, []byte(cfg), 0o644))
	convs, err := loadInput(path, 1)
	require.NoError(t, err)
	require.Len(t, convs, 20)
	common := ""
	for _, c := range convs {
		users := 0
		for _, m := range c.Messages {
			if m.Role == "user" {
				users++
			}
		}
		assert.GreaterOrEqual(t, users, 2)
		assert.LessOrEqual(t, users, 4)
		words := strings.Fields(c.Messages[0].Content)
		assert.GreaterOrEqual(t, len(words), 50+1+10)
		assert.LessOrEqual(t, len(words), 50+300+20)
		prefix := strings.Join(words[:50], " ")
		if common == "" {
			common = prefix
		}
		assert.Equal(t, common, prefix, "the common prefix is shared")
		for _, n := range c.maxTokens {
			assert.Equal(t, 7, n)
		}
	}
}

func TestDistributions(t *testing.T) {
	f := func(v float64) *float64 { return &v }
	tests := []struct {
		name    string
		d       distribution
		lo, hi  int
		wantErr bool
	}{
		{"constant", distribution{Distribution: "constant", Value: f(5)}, 5, 5, false},
		{"uniform", distribution{Distribution: "uniform", Min: f(3), Max: f(6)}, 3, 6, false},
		{"lognormal capped", distribution{Distribution: "lognormal", Average: f(1000), Max: f(1200)}, 1, 1200, false},
		{"zipf capped", distribution{Distribution: "zipf", Alpha: f(2), Max: f(50)}, 1, 50, false},
		{"poisson", distribution{Distribution: "poisson", Alpha: f(10), Max: f(100)}, 1, 100, false},
		{"unknown", distribution{Distribution: "normal"}, 0, 0, true},
		{"missing value", distribution{Distribution: "constant"}, 0, 0, true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			r := newRand(1)
			for range 200 {
				v, err := tt.d.sample(r)
				if tt.wantErr {
					require.Error(t, err)
					return
				}
				require.NoError(t, err)
				assert.GreaterOrEqual(t, v, tt.lo)
				assert.LessOrEqual(t, v, tt.hi)
			}
		})
	}
}

func TestParseFlags(t *testing.T) {
	_, err := parseFlags(nil, io.Discard)
	assert.ErrorContains(t, err, "--input")
	_, err = parseFlags([]string{"--input", "x", "--header", "nocolon"}, io.Discard)
	assert.Error(t, err)
	c, err := parseFlags([]string{"--input", "x", "--clients", "3", "--url", "http://h:1/", "--header", "A: b"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 3, c.maxActive)
	assert.Equal(t, "http://h:1", c.url)
	assert.Equal(t, "b", c.header.Get("A"))
}

func TestOverheadFlags(t *testing.T) {
	c, err := parseOverheadFlags([]string{"--overhead", "--hist", "1KB,2048", "--conc", "1,8", "--modes", "tokens"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, []int{1024, 2048}, c.hists)
	assert.Equal(t, []int{1, 8}, c.concs)
	assert.Equal(t, []string{"tokens"}, c.modes)
	assert.Equal(t, 3, c.repeats)
	assert.Empty(t, c.pinRouter+c.pinRest, "no pinning by default")
	c, err = parseOverheadFlags([]string{"--compare", "/tmp/before", "--compare-label", "66b279c"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "/tmp/before", c.compare)
	assert.Equal(t, "66b279c", c.compareLabel)
	c, err = parseOverheadFlags([]string{"--pin-router", "1", "--pin-rest", "0"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, [2]string{"1", "0"}, [2]string{c.pinRouter, c.pinRest})
	for _, bad := range [][]string{{"--hist", "x"}, {"--conc", "0"}, {"--modes", "both"}, {"--repeats", "0"}, {"--pin-router", "1"}, {"--pin-rest", "0"}} {
		_, err := parseOverheadFlags(bad, io.Discard)
		assert.Error(t, err, "%v", bad)
	}
}

func TestReadStream(t *testing.T) {
	stream := "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}],\"prompt_token_ids\":[1,2]}\n\n" +
		"data: {\"choices\":[{\"delta\":{\"content\":\"Done, \"}}]}\n\ndata: {\"choices\":[{\"delta\":{\"content\":\"ok.\"}}]}\n\ndata: [DONE]\n\n"
	ttft, reply, err := readStream(strings.NewReader(stream), time.Now())
	require.NoError(t, err)
	assert.Equal(t, "Done, ok.", reply)
	assert.Positive(t, ttft)
	_, _, err = readStream(strings.NewReader("data: [DONE]\n\n"), time.Now())
	assert.Error(t, err, "no content")
}

// TestCannedPoolBlocks: the canned engines' pool holds four times the
// handles of the largest run (16 conversations of 400 KB, about 6,400
// blocks each, fill the canned engines' default 100,000), and never less
// than the default.
func TestCannedPoolBlocks(t *testing.T) {
	c, err := parseOverheadFlags([]string{"--hist", "100KB,400KB", "--conc", "1,16"}, io.Discard)
	require.NoError(t, err)
	assert.GreaterOrEqual(t, cannedPoolBlocks(c), 4*16*(400<<10)/64)
	c, err = parseOverheadFlags([]string{"--hist", "1KB", "--conc", "1"}, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 100000, cannedPoolBlocks(c))
}
