package main

import (
	"context"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// quickStart returns the shell block of README.md's quick start.
func quickStart(t *testing.T) string {
	t.Helper()
	b, err := os.ReadFile("README.md")
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)<!-- quickstart:begin[^>]*-->\\s*```sh\\n(.*?)```\\s*<!-- quickstart:end -->").FindSubmatch(b)
	require.NotNil(t, m, "README.md has no quick-start block")
	return string(m[1])
}

// freePorts returns n ports free on 127.0.0.1 a moment ago.
func freePorts(t *testing.T, n int) []string {
	t.Helper()
	var out []string
	for range n {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		defer ln.Close()
		out = append(out, strconv.Itoa(ln.Addr().(*net.TCPAddr).Port))
	}
	return out
}

// The README's quick start, run as written, only with free ports for the
// fixed ones: it builds vllmsim and the proxy, starts them, sends the two
// turns, and the second is a hit.
func TestReadmeQuickStart(t *testing.T) {
	t.Parallel() // slow: real processes or a long stream
	for _, tool := range []string{"bash", "curl", "jq"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("the quick start needs %s: %v", tool, err)
		}
	}
	script := quickStart(t)
	fixed := []string{"8000", "8100", "8200", "5600", "5601"}
	ports := freePorts(t, len(fixed))
	for i, p := range fixed {
		require.Contains(t, script, p)
		script = regexp.MustCompile(`\b`+p+`\b`).ReplaceAllString(script, ports[i])
	}

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, "bash", "-euo", "pipefail", "-c", script)
	root, err := filepath.Abs("../..")
	require.NoError(t, err)
	cmd.Dir = root
	cmd.Env = append(os.Environ(), "TMPDIR="+t.TempDir(), "OPENAI_API_KEY=")
	// Its own process group, so that whatever it left running is stopped.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var out syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &out
	require.NoError(t, cmd.Start())
	pgid := cmd.Process.Pid
	err = cmd.Wait()
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	require.NoError(t, err, "%s", out.String())

	got := out.String()
	assert.Regexp(t, `(?mi)^x-bidikv-reuse: miss\r?$`, got, "turn 1")
	assert.Regexp(t, `(?mi)^x-bidikv-reuse: hit\r?$`, got, "turn 2")
	assert.Contains(t, got, "data: [DONE]")
	assert.Regexp(t, `(?m)^bidikv_reuse_hit_ratio 0\.5$`, got)
	assert.Regexp(t, `(?m)^bidikv_reuse_hits_total 1$`, got)
	assert.NotContains(t, strings.ToLower(got), "error")
}
