package main

import (
	"context"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// readmeBlock returns the shell block of the page file between the
// markers <!-- name:begin ... --> and <!-- name:end -->.
func readmeBlock(t *testing.T, file, name string) string {
	t.Helper()
	b, err := os.ReadFile(file)
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)<!-- " + name + ":begin[^>]*-->\\s*```sh\\n(.*?)```\\s*<!-- " + name + ":end -->").FindSubmatch(b)
	require.NotNil(t, m, "%s has no %s block", file, name)
	return string(m[1])
}

// runReadmeBlock runs the page file's shell block name as written from the
// repository root, only with free ports for the fixed ones the README uses,
// in a process group of its own (so that whatever it left running is
// stopped), bounded to three minutes. It skips the test when bash, curl or
// jq is missing and fails it when the script fails; it returns the
// script's standard output and error.
func runReadmeBlock(t *testing.T, file, name string) (stdout, stderr string) {
	t.Helper()
	for _, tool := range []string{"bash", "curl", "jq"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("README block %s needs %s: %v", name, tool, err)
		}
	}
	script := readmeBlock(t, file, name)
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
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	cmd.Cancel = func() error { return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL) }
	var out, logs syncBuffer
	cmd.Stdout, cmd.Stderr = &out, &logs
	require.NoError(t, cmd.Start())
	pgid := cmd.Process.Pid
	err = cmd.Wait()
	_ = syscall.Kill(-pgid, syscall.SIGTERM)
	require.NoError(t, err, "%s\n%s", out.String(), logs.String())
	return out.String(), logs.String()
}

// freePorts returns n ports free on 127.0.0.1 a moment ago, below the
// ephemeral range: the processes other tests start on port 0 cannot take
// them in the meantime.
func freePorts(t *testing.T, n int) []string {
	t.Helper()
	low := 32768
	if b, err := os.ReadFile("/proc/sys/net/ipv4/ip_local_port_range"); err == nil {
		if f := strings.Fields(string(b)); len(f) == 2 {
			if v, err := strconv.Atoi(f[0]); err == nil && v > 11000 {
				low = v
			}
		}
	}
	var out []string
	for range 1000 {
		if len(out) == n {
			return out
		}
		p := strconv.Itoa(10000 + rand.IntN(low-10000))
		if slices.Contains(out, p) {
			continue
		}
		ln, err := net.Listen("tcp", "127.0.0.1:"+p)
		if err != nil {
			continue
		}
		_ = ln.Close()
		out = append(out, p)
	}
	require.FailNow(t, "no free ports below the ephemeral range")
	return nil
}

// The repository README's quick start, run as written, only with free
// ports for the fixed ones: it builds vllmsim and the proxy, starts them,
// sends the two turns, and the second is a hit.
func TestReadmeQuickStart(t *testing.T) {
	t.Parallel() // slow: real processes or a long stream
	stdout, stderr := runReadmeBlock(t, filepath.Join("..", "..", "README.md"), "quickstart")
	got := stdout + stderr
	assert.Regexp(t, `(?mi)^x-bidikv-reuse: miss\r?$`, got, "turn 1")
	assert.Regexp(t, `(?mi)^x-bidikv-reuse: hit\r?$`, got, "turn 2")
	assert.Contains(t, got, "data: [DONE]")
	assert.Regexp(t, `(?m)^bidikv_reuse_hit_ratio 0\.5$`, got)
	assert.Regexp(t, `(?m)^bidikv_reuse_hits_total 1$`, got)
	assert.NotContains(t, strings.ToLower(got), "error")
}
