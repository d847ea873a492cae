package main

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"os"
	"os/exec"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// vllmsim --help writes its synopsis and every flag by group to stdout,
// each once, its alias on its line, lines within 80 columns, and the
// process exits 0 with nothing on stderr.
func TestHelp(t *testing.T) {
	var out bytes.Buffer
	_, err := parseFlags([]string{"--help"}, &out)
	require.ErrorIs(t, err, flag.ErrHelp)
	text := out.String()
	assert.True(t, strings.HasPrefix(text, "Usage: vllmsim [flags] [MODEL]\n"), text)
	for _, g := range helpGroups {
		assert.Contains(t, text, "\n"+g.Title+":\n")
	}
	assert.NotContains(t, text, "\nOther:\n", "a flag outside the groups")
	assert.Contains(t, text, "\n  --model string, --served-model-name\n")
	assert.Contains(t, text, "\n  --kv-transfer-config JSON\n")
	assert.Contains(t, text, "models no compute", "the synopsis says what --profile changes")
	for _, line := range strings.Split(text, "\n") {
		assert.LessOrEqual(t, len([]rune(line)), 80, line)
	}

	cmd := exec.Command(os.Args[0], "--", "--help")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	require.NoError(t, cmd.Run(), "vllmsim --help exits 0: %s", stderr.String())
	assert.Equal(t, text, stdout.String())
	assert.Empty(t, stderr.String())
}

// TestHelpListsEveryFlagOnce: helpGroups names every flag exactly once
// (aliases included), and nothing else.
func TestHelpListsEveryFlagOnce(t *testing.T) {
	var fs *flag.FlagSet
	captured := func(f *flag.FlagSet) { fs = f }
	_, _ = parseFlagsWith(nil, io.Discard, captured)
	require.NotNil(t, fs)
	seen := map[string]int{}
	for _, g := range helpGroups {
		for _, spec := range g.Flags {
			for _, n := range strings.Split(spec, ",") {
				seen[n]++
				assert.NotNil(t, fs.Lookup(n), "helpGroups names an unknown flag %q", n)
			}
		}
	}
	fs.VisitAll(func(f *flag.Flag) { assert.Equal(t, 1, seen[f.Name], f.Name) })
}

// A mistyped flag is one error naming it and the nearest flag; the
// process exits 2 and prints it once.
func TestFlagTypo(t *testing.T) {
	for _, tc := range []struct{ arg, want string }{
		{"--blok-size", "unknown flag --blok-size (did you mean --block-size?); vllmsim --help lists the flags"},
		{"--kv-transfer-confg", "(did you mean --kv-transfer-config?)"},
		{"--prefix-caching", "(did you mean --no-enable-prefix-caching?)"},
		{"--zzzzzz", "unknown flag --zzzzzz; vllmsim --help lists the flags"},
	} {
		var out bytes.Buffer
		_, err := parseFlags([]string{tc.arg, "1"}, &out)
		require.Error(t, err)
		assert.True(t, errors.Is(err, errUsage), "%v", err)
		assert.Contains(t, err.Error(), tc.want)
		assert.Empty(t, out.String(), "nothing written: main prints the error once")
	}
	cmd := exec.Command(os.Args[0], "--", "--blok-size", "64")
	cmd.Env = append(os.Environ(), childEnv+"=1")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	err := cmd.Run()
	var exit *exec.ExitError
	require.ErrorAs(t, err, &exit)
	assert.Equal(t, 2, exit.ExitCode())
	assert.Equal(t, "vllmsim: invalid command line: unknown flag --blok-size (did you mean --block-size?); vllmsim --help lists the flags\n", stderr.String())
}
