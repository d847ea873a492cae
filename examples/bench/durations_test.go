package main

import (
	"bytes"
	"io"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// Every duration flag of every bench mode, found in the mode's
// own -h listing (a flag added later is covered), refuses a negative value
// with an error that names it and its value as written.
func TestDurationFlags(t *testing.T) {
	modes := map[string]func(args []string, w io.Writer) error{
		"bench":          func(a []string, w io.Writer) error { _, err := parseFlags(a, w); return err },
		"--attack":       func(a []string, w io.Writer) error { _, err := parseAttackFlags(a, w); return err },
		"--fleet":        func(a []string, w io.Writer) error { _, err := parseFleetFlags(a, w); return err },
		"--overhead":     func(a []string, w io.Writer) error { _, err := parseOverheadFlags(a, w); return err },
		"--replay-trace": func(a []string, w io.Writer) error { _, err := parseReplayFlags(a, w); return err },
	}
	durations := regexp.MustCompile(`(?m)^\s+--?([^-\s]\S*) duration\b`)
	total := 0
	for mode, parse := range modes {
		var out bytes.Buffer
		_ = parse([]string{"-h"}, &out)
		for _, m := range durations.FindAllStringSubmatch(out.String(), -1) {
			total++
			name := m[1]
			for _, v := range []string{"-5s", "-1500ms"} {
				err := parse([]string{"--" + name, v}, io.Discard)
				require.Error(t, err, "%s --%s %s", mode, name, v)
				assert.Equal(t, "--"+name+" "+v+": must not be negative", err.Error(), mode)
			}
		}
	}
	assert.GreaterOrEqual(t, total, 8, "the duration flags found")
}
