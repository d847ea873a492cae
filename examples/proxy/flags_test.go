package main

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"io"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/durflag"
)

// TestHelp: --help exits 0 (flag.ErrHelp, which main maps to 0) with a
// synopsis named bidikv-proxy and every flag once, by group, its aliases
// on its line and byte sizes in human units; the doctor's help too.
func TestHelp(t *testing.T) {
	for _, tc := range []struct {
		args []string
		head string
	}{
		{[]string{"--help"}, "Usage: bidikv-proxy [flags]\n       bidikv-proxy doctor [flags] [--probe]\n\nbidikv-proxy routes multi-turn conversations"},
		{[]string{"-h"}, "Usage: bidikv-proxy [flags]"},
		{[]string{"doctor", "--help"}, "Usage: bidikv-proxy doctor [engine flags] [--probe] [--json] [--strict]\n\nAsks every engine"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			err := run(context.Background(), tc.args, noEnv, &stdout, &stderr)
			require.ErrorIs(t, err, flag.ErrHelp)
			out := stdout.String()
			assert.True(t, strings.HasPrefix(out, tc.head), out)
			assert.Empty(t, stderr.String())
			for _, g := range []string{"\nEngines:\n", "\nReuse and verification:\n", "\nLimits:\n", "\nTimeouts:\n", "\nObservability:\n", "\nDeployment:\n"} {
				assert.Contains(t, out, g)
			}
			assert.NotContains(t, out, "\nOther:\n", "a flag outside the groups")
			assert.Contains(t, out, "  --prefiller-hosts HOST..., --prefiller-host\n")
			assert.Equal(t, 1, strings.Count(out, "--prefiller-host\n"), "an alias listed once, beside its flag")
			assert.NotContains(t, out, "\n  --prefiller-host ")
			assert.Contains(t, out, "  --max-body-bytes SIZE\n      largest request body accepted (413 above) (default 32MiB)\n")
			assert.Contains(t, out, "(default 256MiB)")
			assert.Contains(t, out, "(default 64KiB)")
			for _, line := range strings.Split(out, "\n") {
				assert.LessOrEqual(t, len([]rune(line)), 80, line)
			}
			if tc.args[0] == "doctor" {
				assert.Contains(t, out, "\nDoctor:\n  --probe\n")
			} else {
				assert.NotContains(t, out, "\n  --probe")
			}
		})
	}
}

// TestHelpListsEveryFlagOnce: helpGroups names every flag of the proxy and
// the doctor exactly once (aliases included), and nothing else.
func TestHelpListsEveryFlagOnce(t *testing.T) {
	var fs *flag.FlagSet
	_, _ = parseCommand("x", "", []string{"--help"}, noEnv, io.Discard, func(f *flag.FlagSet) {
		fs = f
		(&doctorOptions{}).flags(f)
	})
	seen := map[string]int{}
	for _, g := range helpGroups {
		for _, spec := range g.flags {
			for _, n := range strings.Split(spec, ",") {
				seen[n]++
				assert.NotNil(t, fs.Lookup(n), "helpGroups names an unknown flag %q", n)
			}
		}
	}
	fs.VisitAll(func(f *flag.Flag) { assert.Equal(t, 1, seen[f.Name], f.Name) })
}

// TestFlagErrors: a typo'd flag is one line naming it, with the nearest
// flag and where the flags are listed; nothing is written (main prints the
// error once); values name their flag as written, --name.
func TestFlagErrors(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--mx-body-bytes", "1"}, "bidikv-proxy: invalid command line: unknown flag --mx-body-bytes (did you mean --max-body-bytes?); bidikv-proxy --help lists the flags"},
		{[]string{"--prefil", "http://p:1"}, "unknown flag --prefil (did you mean --prefill?)"},
		{[]string{"-decoder-ports", "1", "--verificaton", "content"}, "unknown flag --verificaton (did you mean --verification?)"},
		{[]string{"--max-body"}, "unknown flag --max-body (did you mean --max-body-bytes?)"},
		{[]string{"--verbose"}, "unknown flag --verbose; bidikv-proxy --help lists the flags"},
		{[]string{"doctor", "--prob"}, "unknown flag --prob (did you mean --probe?); bidikv-proxy doctor --help lists the flags"},
		{[]string{"--port", "x"}, `invalid value "x" for flag --port: parse error`},
		{[]string{"--max-body-bytes", "3XB"}, `invalid value "3XB" for flag --max-body-bytes: unknown unit "XB"`},
		{[]string{"--max-body-bytes", "1.5B"}, `invalid value "1.5B" for flag --max-body-bytes: not a whole number of bytes`},
		{[]string{"--host"}, "flag needs an argument: --host"},
		{[]string{"--retention-ttl", "600s", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"},
			"bidikv-proxy: invalid command line: --retention-ttl: 10m0s leaves less than 5s under the engines' decoder_kv_blocks_ttl of 8m0s; use at most 7m55s (or raise --decoder-kv-blocks-ttl to match the engines)"},
		{[]string{"--kv-bytes-per-token", "-1", "--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"}, "--kv-bytes-per-token: -1 is negative"},
	} {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			args := tc.args
			if args[0] != "doctor" {
				args = append([]string{"--port", "0"}, args...)
			}
			err := run(context.Background(), args, noEnv, &stdout, &stderr)
			require.Error(t, err)
			assert.True(t, errors.Is(err, errUsage), "exit status 2: %v", err)
			assert.Contains(t, err.Error(), tc.want)
			assert.NotContains(t, err.Error(), "kvroute", "the flag, not the library option")
			assert.NotRegexp(t, `\bWith[A-Z]`, err.Error())
			assert.NotContains(t, err.Error(), "\n")
			assert.Empty(t, stdout.String())
			assert.Empty(t, stderr.String())
		})
	}
}

// TestByteSizes: sizes are accepted in bytes or human units and shown in
// binary units.
func TestByteSizes(t *testing.T) {
	for in, want := range map[string]int64{
		"33554432": 32 << 20, "32MiB": 32 << 20, "32mib": 32 << 20, "64KiB": 64 << 10, "1GiB": 1 << 30,
		"1.5MiB": 3 << 19, "2MB": 2e6, "100kB": 1e5, "512B": 512, " 8 MiB ": 8 << 20, "1TiB": 1 << 40,
	} {
		n, err := parseBytes(in)
		require.NoError(t, err, in)
		assert.Equal(t, want, n, in)
	}
	for _, bad := range []string{"", "MiB", "-1", "1.1B", "1e6", "1 XiB", "0x10", "99999999999TiB"} {
		_, err := parseBytes(bad)
		assert.Error(t, err, bad)
	}
	for n, want := range map[int64]string{32 << 20: "32MiB", 64 << 10: "64KiB", 3 << 19: "1536KiB", 1000: "1000", 0: "0", 1 << 40: "1TiB"} {
		assert.Equal(t, want, formatBytes(n))
	}
	c, err := parseConfig([]string{"--max-body-bytes", "1MiB", "--max-buffered-bytes", "64MiB", "--max-header-bytes", "16KiB"}, noEnv, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, int64(1<<20), c.maxBodyBytes)
	assert.Equal(t, int64(64<<20), c.maxBufferedBytes)
	assert.Equal(t, 16<<10, c.maxHeaderBytes)
	_, err = parseConfig([]string{"--max-body-bytes", "64MiB", "--max-buffered-bytes", "32MiB"}, noEnv, io.Discard)
	assert.ErrorContains(t, err, "--max-buffered-bytes 33554432 is below --max-body-bytes 67108864")
}

// Issue 29.3: one rule for every duration flag of the proxy and the
// doctor, found by their type (a flag added later is covered): a negative
// value is refused, its error naming the flag and the value as written;
// 0 is refused by the flags whose 0 means nothing (positiveDurations) and
// taken by the others (none: no bound, no reads, at once).
func TestDurationFlags(t *testing.T) {
	var fs *flag.FlagSet
	_, _ = parseCommand("x", "", []string{"--help"}, noEnv, io.Discard, func(f *flag.FlagSet) {
		fs = f
		(&doctorOptions{}).flags(f)
	})
	names := durflag.Names(fs)
	require.GreaterOrEqual(t, len(names), 19, names)
	for _, p := range positiveDurations {
		assert.Contains(t, names, p, "positiveDurations names a flag that is not a duration")
	}
	engines := []string{"--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:1"}
	parse := func(args ...string) error {
		_, err := parseCommand("x", "", append(slices.Clone(engines), args...), noEnv, io.Discard, (&doctorOptions{}).flags)
		return err
	}
	for _, name := range names {
		t.Run(name, func(t *testing.T) {
			for _, v := range []string{"-5s", "-1500ms", "-1ns"} {
				err := parse("--"+name, v)
				require.Error(t, err)
				assert.ErrorIs(t, err, errUsage)
				assert.Equal(t, "bidikv-proxy: invalid command line: --"+name+" "+v+": must not be negative", err.Error())
				err = parse("--" + name + "=" + v)
				require.Error(t, err)
				assert.Contains(t, err.Error(), "--"+name+" "+v+": must not be negative")
			}
			err := parse("--"+name, "0s")
			if slices.Contains(positiveDurations, name) {
				assert.EqualError(t, err, "bidikv-proxy: invalid command line: --"+name+" 0s: must be positive")
			} else if err != nil {
				assert.NotContains(t, err.Error(), "--"+name+" ", "0 means none for --%s", name)
			}
		})
	}
}
