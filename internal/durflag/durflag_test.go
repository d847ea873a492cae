package durflag_test

import (
	"flag"
	"io"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/durflag"
)

func flags() *flag.FlagSet {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Duration("timeout", time.Second, "")
	fs.Duration("grace", 0, "")
	fs.Bool("verbose", false, "")
	fs.String("name", "", "")
	return fs
}

// Every duration flag refuses a negative value and, when named positive,
// 0; the error shows the value as written, wherever it stands among the
// flags (after a boolean, as --name=value, given twice).
func TestCheck(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"--timeout", "-5s"}, "--timeout -5s: must not be negative"},
		{[]string{"--verbose", "--timeout", "-5000ms"}, "--timeout -5000ms: must not be negative"},
		{[]string{"-timeout=-1.5h", "--name", "-x"}, "--timeout -1.5h: must not be negative"},
		{[]string{"--timeout", "1s", "--timeout", "-90s"}, "--timeout -90s: must not be negative"},
		{[]string{"--grace", "-1ns"}, "--grace -1ns: must not be negative"},
		{[]string{"--timeout", "0"}, "--timeout 0: must be positive"},
		{[]string{"--grace", "0s"}, ""},
		{[]string{"--name", "--timeout", "--timeout", "2s"}, ""},
	} {
		fs := flags()
		require.NoError(t, fs.Parse(tc.args), tc.args)
		err := durflag.Check(fs, tc.args, "timeout")
		if tc.want == "" {
			assert.NoError(t, err, tc.args)
			continue
		}
		assert.EqualError(t, err, tc.want, tc.args)
	}
	assert.Equal(t, []string{"grace", "timeout"}, durflag.Names(flags()))
}
