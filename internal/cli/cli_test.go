package cli_test

import (
	"bytes"
	"errors"
	"flag"
	"io"
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/cli"
)

func flags() *flag.FlagSet {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Int("port", 8000, "port to serve on")
	fs.String("kv-transfer-config", "", "vLLM KV transfer config JSON")
	fs.Int("block-size", 16, "KV block size in tokens")
	fs.Bool("verbose", false, "log engine events")
	fs.String("stray", "", "a flag in no group")
	fs.Bool("served-model-name", false, "alias")
	return fs
}

// WriteHelp lists each flag once, under its group's title, with its
// aliases on its line, and the rest under Other.
func TestWriteHelp(t *testing.T) {
	var b bytes.Buffer
	cli.WriteHelp(&b, flags(), "Usage: x\n", []cli.Group{
		{"Serving", []string{"port", "verbose"}},
		{"KV", []string{"kv-transfer-config", "block-size", "unknown"}},
		{"Empty", []string{"none"}},
		{"", []string{"served-model-name"}},
	}, func(f *flag.Flag) string {
		if f.Name == "kv-transfer-config" {
			return "JSON"
		}
		return ""
	})
	assert.Equal(t, `Usage: x

Serving:
  --port int
      port to serve on (default 8000)
  --verbose
      log engine events

KV:
  --kv-transfer-config JSON
      vLLM KV transfer config JSON
  --block-size int
      KV block size in tokens (default 16)

Other:
  --stray string
      a flag in no group
`, b.String())
}

func TestClosest(t *testing.T) {
	fs := flags()
	for name, want := range map[string]string{
		"prot":        "port",
		"blok-size":   "block-size",
		"BLOCK-SIZE":  "block-size",
		"kv-transfer": "kv-transfer-config",
		"zzz":         "",
		"verbosity":   "verbose",
	} {
		assert.Equal(t, want, cli.Closest(fs, name), name)
	}
}

func TestUnknownFlag(t *testing.T) {
	fs := flags()
	err := fs.Parse([]string{"--blok-size", "64"})
	name, ok := cli.UnknownFlag(err)
	require.True(t, ok)
	assert.Equal(t, "blok-size", name)
	_, ok = cli.UnknownFlag(errors.New("invalid value"))
	assert.False(t, ok)
	_, ok = cli.UnknownFlag(nil)
	assert.False(t, ok)
}

// A terminal is a character device; a file, a pipe or a buffer is not.
func TestIsTerminal(t *testing.T) {
	assert.False(t, cli.IsTerminal(&bytes.Buffer{}))
	assert.False(t, cli.IsTerminal((*os.File)(nil)))
	f, err := os.Create(filepath.Join(t.TempDir(), "out"))
	require.NoError(t, err)
	defer f.Close()
	assert.False(t, cli.IsTerminal(f), "a regular file")
	r, w, err := os.Pipe()
	require.NoError(t, err)
	defer r.Close()
	defer w.Close()
	assert.False(t, cli.IsTerminal(w), "a pipe")
	if null, err := os.OpenFile(os.DevNull, os.O_WRONLY, 0); err == nil {
		defer null.Close()
		assert.True(t, cli.IsTerminal(null), "a character device (%s)", os.DevNull)
	}
}
