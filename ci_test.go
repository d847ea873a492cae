package bidikv_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// .ci/run waits for another package manager's lock instead of failing at
// once: apt-get gets DPkg::Lock::Timeout (dpkg's lock, for install), and an
// update that finds the lists lock held is run again until it is free, or
// until the wait is over. Other failures fail at once. A fake apt-get on
// PATH plays the other package manager.
func TestCIWaitsForPackageLock(t *testing.T) {
	bash, err := exec.LookPath("bash")
	if err != nil {
		t.Skip("no bash")
	}
	script, err := filepath.Abs(filepath.Join(".ci", "run"))
	require.NoError(t, err)
	run := func(t *testing.T, fake string, cmd string) (string, error) {
		dir := t.TempDir()
		require.NoError(t, os.WriteFile(filepath.Join(dir, "apt-get"), []byte("#!/usr/bin/env bash\n"+fake), 0o755))
		for _, tool := range []string{"make", "npm"} { // main must not run: these would tell
			require.NoError(t, os.WriteFile(filepath.Join(dir, tool), []byte("#!/bin/sh\necho MAIN RAN; exit 1\n"), 0o755))
		}
		// Sourced, and told so: only the functions, never main (make test).
		c := exec.Command(bash, "-c", `source "$1"; `+cmd, "bash", script)
		c.Env = append(os.Environ(), "CI_FUNCTIONS_ONLY=1", "PATH="+dir+":"+os.Getenv("PATH"), "CI_LOCK_WAIT=30", "CI_LOCK_WAIT_STEP=0",
			"CALLS="+filepath.Join(dir, "calls"))
		out, err := c.CombinedOutput()
		require.NotContains(t, string(out), "MAIN RAN", "sourcing .ci/run defines functions only")
		calls, _ := os.ReadFile(filepath.Join(dir, "calls"))
		return string(out) + "\n--calls--\n" + string(calls), err
	}
	// Held for the first two calls, then free.
	const heldTwice = `echo "$*" >> "$CALLS"
n=$(wc -l < "$CALLS")
if [ "$n" -le 2 ]; then echo "E: Could not get lock /var/lib/apt/lists/lock. It is held by process 42 (apt-get)" >&2; exit 100; fi
echo updated`

	t.Run("update waits for the lists lock", func(t *testing.T) {
		out, err := run(t, heldTwice, "apt_get update -qq")
		require.NoError(t, err, out)
		assert.Equal(t, 3, strings.Count(out, "-o DPkg::Lock::Timeout=30 update -qq"), out)
		assert.Contains(t, out, "another package manager holds the lock; waiting")
	})
	t.Run("install gets dpkg's lock timeout", func(t *testing.T) {
		out, err := run(t, `echo "$*" >> "$CALLS"; echo "frontend=$DEBIAN_FRONTEND" >> "$CALLS"`,
			"DEBIAN_FRONTEND=noninteractive apt_get install -y -qq jq")
		require.NoError(t, err, out)
		assert.Contains(t, out, "-o DPkg::Lock::Timeout=30 install -y -qq jq")
		assert.Contains(t, out, "frontend=noninteractive")
	})
	t.Run("other failures fail at once", func(t *testing.T) {
		out, err := run(t, `echo "$*" >> "$CALLS"; echo "E: Unable to locate package nope" >&2; exit 100`, "apt_get install -y nope")
		require.Error(t, err, out)
		assert.Equal(t, 1, strings.Count(out, "install -y nope"), out)
		assert.Contains(t, out, "Unable to locate package nope")
	})
	t.Run("a lock held past the wait fails", func(t *testing.T) {
		out, err := run(t, `echo "$*" >> "$CALLS"; echo "E: Could not get lock /var/lib/apt/lists/lock" >&2; exit 100`,
			"lock_wait=0; apt_get update")
		require.Error(t, err, out)
		assert.Contains(t, out, "Could not get lock")
	})
}
