package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// runBench runs bench's main in a child process and returns its stdout,
// stderr and exit status.
func runBench(t *testing.T, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"--"}, args...)...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	code := 0
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		code = exit.ExitCode()
	} else {
		require.NoError(t, err)
	}
	return stdout.String(), stderr.String(), code
}

// bench --help lists every mode with a line each and exits 0; each mode's
// --help lists its flags and exits 0; a mistyped flag names the nearest.
func TestHelpListsEveryMode(t *testing.T) {
	stdout, stderr, code := runBench(t, "--help")
	assert.Zero(t, code, stderr)
	assert.Empty(t, stderr)
	assert.True(t, strings.HasPrefix(stdout, "Usage: bench "), stdout)
	for _, m := range []string{"--overhead", "--fleet", "--replay-trace", "--attack", "(default)"} {
		assert.Regexp(t, `(?m)^  `+regexpQuote(m)+` +\S`, stdout, "a line for mode %s", m)
	}
	assert.Len(t, modes, 5, "a new mode gets a line in --help (and in this test)")
	assert.Contains(t, stdout, "\nFlags of the default mode:\n  --clients int\n")
	for _, line := range strings.Split(stdout, "\n") {
		assert.LessOrEqual(t, len([]rune(line)), 80, line)
	}
	for _, m := range modes[1:] {
		out, errOut, code := runBench(t, m.flag, "--help")
		assert.Zero(t, code, "%s --help: %s", m.flag, errOut)
		assert.Empty(t, errOut)
		assert.True(t, strings.HasPrefix(out, "Usage: bench "+m.flag+" [flags]\n"), out)
		assert.Contains(t, out, "\nFlags:\n  --")
		assert.NotContains(t, out, "\n  "+m.flag+"\n", "the mode's own switch is not listed as a flag")
	}
	_, errOut, code := runBench(t, "--fleet", "--sesions", "3")
	assert.Equal(t, 1, code)
	assert.Equal(t, "bench: unknown flag --sesions (did you mean --sessions?); bench --fleet --help lists the flags\n", errOut)
}

func regexpQuote(s string) string {
	return strings.NewReplacer("(", `\(`, ")", `\)`).Replace(s)
}

// A run in which every request failed measured nothing: bench prints its
// summary, then the first error, and exits non-zero.
func TestEveryRequestFailed(t *testing.T) {
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusServiceUnavailable)
		_, _ = io.WriteString(w, `{"error":{"message":"no decode endpoint available"}}`)
	}))
	t.Cleanup(srv.Close)
	in := filepath.Join(t.TempDir(), "conv.json")
	raw, err := json.Marshal([]map[string]any{{"id": "a", "messages": []map[string]string{{"role": "user", "content": "hi"}}},
		{"id": "b", "messages": []map[string]string{{"role": "user", "content": "hello"}}}})
	require.NoError(t, err)
	require.NoError(t, os.WriteFile(in, raw, 0o644))

	var stdout, stderr bytes.Buffer
	err = runMain(context.Background(), []string{"--url", srv.URL, "--input", in}, &stdout, &stderr)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "every request failed (2 of 2); the first: status 503: ")
	assert.Contains(t, err.Error(), "no decode endpoint available")
	assert.Contains(t, stdout.String(), "requests", "the summary is still printed")
	assert.Empty(t, stderr.String(), "no progress lines off a terminal")

	_, errOut, code := runBench(t, "--url", srv.URL, "--input", in)
	assert.Equal(t, 1, code)
	assert.Contains(t, errOut, "bench: every request failed (2 of 2); the first: status 503")

	// one success among failures is a run that measured something
	assert.NoError(t, allFailed([]record{{Error: "x"}, {}}))
	assert.NoError(t, allFailed(nil))
}

// Progress lines go to a terminal only; there, one a tick.
func TestProgressLines(t *testing.T) {
	assert.Equal(t, io.Discard, progressOut(&bytes.Buffer{}))
	f, err := os.Create(filepath.Join(t.TempDir(), "log"))
	require.NoError(t, err)
	defer f.Close()
	assert.Equal(t, io.Discard, progressOut(f), "a file")
	calls := 0
	every(io.Discard, time.Millisecond, func() string { calls++; return "x" })()
	assert.Zero(t, calls)

	var mu sync.Mutex
	var b bytes.Buffer
	w := writerFunc(func(p []byte) (int, error) { mu.Lock(); defer mu.Unlock(); return b.Write(p) })
	n := 0
	stop := every(w, 5*time.Millisecond, func() string { n++; return "bench: line" })
	require.Eventually(t, func() bool { mu.Lock(); defer mu.Unlock(); return strings.Count(b.String(), "\n") >= 2 }, 5*time.Second, time.Millisecond)
	stop()
	mu.Lock()
	lines := strings.Count(b.String(), "bench: line\n")
	mu.Unlock()
	assert.GreaterOrEqual(t, lines, 2)
	time.Sleep(20 * time.Millisecond)
	mu.Lock()
	assert.Equal(t, lines, strings.Count(b.String(), "\n"), "nothing after stop")
	mu.Unlock()
}

type writerFunc func([]byte) (int, error)

func (f writerFunc) Write(p []byte) (int, error) { return f(p) }
