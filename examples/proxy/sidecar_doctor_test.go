package main

import (
	"context"
	"flag"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// runSidecarDoctorTest runs `bidikv-proxy doctor --sidecar` with args and
// returns its report and error.
func runSidecarDoctorTest(t *testing.T, args ...string) (string, error) {
	t.Helper()
	var out, errOut syncBuffer
	err := run(context.Background(), append([]string{"doctor", "--sidecar", "--secure-proxy=false", "--log-level", "error"}, args...), noEnv, &out, &errOut)
	return out.String(), err
}

// doctor --sidecar: a working setup passes every check; a local engine
// that does not answer, a header engine outside the SSRF allowlist and a
// picker configuration reading a metric the sidecar does not export each
// fail with a fix; an incoherent command line is a usage error.
func TestSidecarDoctor(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	d, err := url.Parse(cl.Decode[0].URL())
	require.NoError(t, err)
	local := []string{"--local-host", d.Hostname(), "--model-server-port", d.Port()}
	p := hostPort(t, cl.Prefill[0].URL())

	args := append(append([]string{}, local...), "--prefiller-host-port", p, "--picker-config", "deploy/llm-d/epp-config.yaml",
		"--prefill", cl.Prefill[0].URL())
	if _, err := exec.LookPath("redis-server"); err == nil { // the store check, when Redis can run here
		args = append(args, "--redis-url", redisServer(t))
	}
	out, err := runSidecarDoctorTest(t, args...)
	require.NoError(t, err, out)
	for _, want := range []string{"ok    flags: the sidecar accepts this command line", "ok    local engine " + cl.Decode[0].URL() + ": answers",
		"ok    header: prefill engine " + p + " answers", "ok    picker config: reads 3 sidecar figures"} {
		assert.Contains(t, out, want)
	}
	assert.NotContains(t, out, "FAIL")

	bad := filepath.Join(t.TempDir(), "epp.yaml")
	require.NoError(t, os.WriteFile(bad, []byte("plugins:\n- type: core-metrics-extractor\n  parameters:\n    engineConfigs:\n    - name: vllm\n      customMetrics:\n      - attributeKey: bidikv.held\n        metricSpec: bidikv_held_tokens\n- type: endpoint-attribute-scorer\n  name: s\n  parameters:\n    attributeKey: bidikv.pressure\n"), 0o600))
	out, err = runSidecarDoctorTest(t, "--local-host", "127.0.0.1", "--model-server-port", "1",
		"--enable-ssrf-protection", "--inference-pool", "pool", "--ssrf-allowlist", "10.0.0.0/8", "--prefiller-host-port", p, "--picker-config", bad)
	require.ErrorIs(t, err, errSidecarDoctor, out)
	for _, want := range []string{"FAIL  local engine http://127.0.0.1:1:", "fix: start vLLM on --model-server-port",
		"FAIL  header: " + p + " is outside the SSRF allowlist", "FAIL  picker config: customMetrics bidikv.held reads bidikv_held_tokens, which the sidecar does not export",
		"FAIL  picker config: scorer s reads attribute bidikv.pressure", "warn  store: no --redis-url"} {
		assert.Contains(t, out, want)
	}

	_, err = runSidecarDoctorTest(t, "--kv-connector", "sglang")
	require.ErrorIs(t, err, errUsage)
	assert.ErrorContains(t, err, "--kv-connector sglang")

	var help syncBuffer
	err = run(context.Background(), []string{"doctor", "--sidecar", "--help"}, noEnv, &help, &help)
	require.ErrorIs(t, err, flag.ErrHelp)
	assert.True(t, strings.HasPrefix(help.String(), "Usage: bidikv-proxy doctor --sidecar"), help.String())
	assert.Contains(t, help.String(), "--prefiller-host-port")
}
