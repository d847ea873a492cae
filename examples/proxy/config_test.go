package main

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
)

func noEnv(string) string { return "" }

func TestParseConfig(t *testing.T) {
	tests := []struct {
		name            string
		args            []string
		prefill, decode []string
	}{
		{"defaults as the reference proxy", nil,
			[]string{"http://localhost:8100"}, []string{"http://localhost:8200"}},
		{"singular names", []string{"--prefiller-host", "p", "--prefiller-port", "1", "--decoder-host", "d", "--decoder-port", "2"},
			[]string{"http://p:1"}, []string{"http://d:2"}},
		{"nargs lists", []string{"--prefiller-hosts", "a", "b", "--prefiller-ports", "1", "2", "--decoder-hosts", "c", "--decoder-ports", "3"},
			[]string{"http://a:1", "http://b:2"}, []string{"http://c:3"}},
		{"repeated and comma lists", []string{"--decoder-hosts", "a,b", "--decoder-ports", "1", "--decoder-ports", "2"},
			[]string{"http://localhost:8100"}, []string{"http://a:1", "http://b:2"}},
		{"equals form", []string{"--prefiller-hosts=x", "--prefiller-ports=9"},
			[]string{"http://x:9"}, []string{"http://localhost:8200"}},
		{"bracketed IPv6", []string{"--decoder-hosts", "[::1]", "--decoder-ports", "8"},
			[]string{"http://localhost:8100"}, []string{"http://[::1]:8"}},
		{"URL lists", []string{"--prefill", "http://p1:1", "http://p2:2", "--decode", "d:3"},
			[]string{"http://p1:1", "http://p2:2"}, []string{"http://d:3"}},
		{"addresses as the router reads them", []string{"--prefill", "127.0.0.1:8100/", "https://p:2/engine-a/", "--decode", "[::1]:8200"},
			[]string{"http://127.0.0.1:8100", "https://p:2/engine-a"}, []string{"http://[::1]:8200"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseConfig(tt.args, noEnv, io.Discard)
			require.NoError(t, err)
			assert.Equal(t, tt.prefill, c.prefillURLs)
			assert.Equal(t, tt.decode, c.decodeURLs)
		})
	}
}

func TestParseConfigErrors(t *testing.T) {
	tests := []struct {
		name, want string
		args       []string
	}{
		{"count mismatch", "2 --prefiller-hosts but 1 --prefiller-ports", []string{"--prefiller-hosts", "a", "b", "--prefiller-ports", "1"}},
		{"decoder count mismatch", "1 --decoder-hosts but 2 --decoder-ports", []string{"--decoder-ports", "1", "2"}},
		{"bad port", `"x" is not a port`, []string{"--decoder-ports", "x"}},
		{"URLs and pairs", "use either --prefill or", []string{"--prefill", "p:1", "--prefiller-hosts", "a"}},
		{"scheme", `--decode: transport: invalid endpoint "ftp://d:1": scheme must be http or https`, []string{"--decode", "ftp://d:1"}},
		{"numeric host", `--prefill: transport: invalid endpoint "8100": numeric-only host`, []string{"--prefill", "8100"}},
		{"unknown flag", "unknown flag --nope", []string{"--nope"}},
		{"stray argument", `unexpected argument "x"`, []string{"--port", "1", "x"}},
		{"log level", "--log-level", []string{"--log-level", "loud"}},
		{"log format", "--log-format", []string{"--log-format", "xml"}},
		{"key mode", "--key-mode", []string{"--key-mode", "guess"}},
		{"verification", "--verification \"bytes\": use tokens or content", []string{"--verification", "bytes"}},
		{"block size", "--block-size", []string{"--block-size", "-16"}},
		{"grace", "--shutdown-grace", []string{"--shutdown-grace", "-1s"}},
		{"restart check", "--restart-check", []string{"--restart-check", "-1s"}},
		{"render timeout", "--render-timeout", []string{"--render-timeout", "0s"}},
		{"decode-local by content", "--decode-local needs --verification tokens: a turn goes decode-local only with a handle verified by tokens, so with --verification content it never would",
			[]string{"--decode-local", "--verification", "content"}},
		{"decode-local by content, flags the other way round", "--decode-local needs --verification tokens",
			[]string{"--verification=content", "--decode-local=true"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := parseConfig(tt.args, noEnv, io.Discard)
			require.Error(t, err)
			assert.True(t, errors.Is(err, errUsage))
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

func TestParseConfigSettings(t *testing.T) {
	env := map[string]string{"OPENAI_API_KEY": "sk-up"}
	c, err := parseConfig([]string{
		"--retention-ttl", "100s", "--recompute-threshold", "0", "--api-key", "k1", "k2",
		"--max-body-bytes", "1024", "--shutdown-grace", "3s", "--reuse=false", "--key-mode", "conversation-id",
		"--log-level", "debug", "--log-format", "json", "--verification", "content", "--block-size", "32",
	}, func(k string) string { return env[k] }, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "content", c.verification)
	assert.Equal(t, 32, c.blockSize)
	assert.Equal(t, 100*time.Second, c.retentionTTL)
	assert.Equal(t, 0, c.recomputeThresh)
	assert.Equal(t, []string{"k1", "k2"}, c.apiKeys)
	assert.Equal(t, int64(1024), c.maxBodyBytes)
	assert.Equal(t, 3*time.Second, c.shutdownGrace)
	assert.False(t, c.reuse)
	assert.Equal(t, keyConversationID, c.keyMode)
	assert.Equal(t, "sk-up", c.upstreamAPIKey)
	assert.Equal(t, "json", c.logFormat)
	assert.Len(t, c.routerOptions(), 13, "upstream key and identifier options added")
}

// --key-mode conversation-id needs inbound keys, or an explicit flag that
// accepts one tenant for every client.
func TestConversationIDNeedsKeys(t *testing.T) {
	_, err := parseConfig([]string{"--key-mode", "conversation-id"}, noEnv, io.Discard)
	require.Error(t, err)
	assert.ErrorIs(t, err, errUsage)
	assert.Contains(t, err.Error(), "--allow-anonymous-conversation-id")

	for name, args := range map[string][]string{
		"explicit flag": {"--key-mode", "conversation-id", "--allow-anonymous-conversation-id"},
		"--api-key":     {"--key-mode", "conversation-id", "--api-key", "k"},
	} {
		t.Run(name, func(t *testing.T) {
			_, err := parseConfig(args, noEnv, io.Discard)
			assert.NoError(t, err)
		})
	}
	t.Run(envAPIKeys, func(t *testing.T) {
		c, err := parseConfig([]string{"--key-mode", "conversation-id"},
			func(k string) string { return map[string]string{envAPIKeys: " k1, ,k2 "}[k] }, io.Discard)
		require.NoError(t, err)
		assert.Equal(t, []string{"k1", "k2"}, c.apiKeys)
	})
}

func TestAPIKeyFile(t *testing.T) {
	dir := t.TempDir()
	f := filepath.Join(dir, "keys")
	require.NoError(t, os.WriteFile(f, []byte("# proxy keys\nsk-a\n\n  sk-b  \r\n"), 0o600))
	c, err := parseConfig([]string{"--api-key-file", f, "--api-key", "sk-c"},
		func(k string) string { return map[string]string{envAPIKeys: "sk-d"}[k] }, io.Discard)
	require.NoError(t, err)
	assert.ElementsMatch(t, []string{"sk-a", "sk-b", "sk-c", "sk-d"}, c.apiKeys)

	empty := filepath.Join(dir, "empty")
	require.NoError(t, os.WriteFile(empty, []byte("# none yet\n"), 0o600))
	for name, path := range map[string]string{"missing": filepath.Join(dir, "nope"), "no key": empty} {
		t.Run(name, func(t *testing.T) {
			_, err := parseConfig([]string{"--api-key-file", path}, noEnv, io.Discard)
			require.Error(t, err)
			assert.ErrorIs(t, err, errUsage)
			assert.Contains(t, err.Error(), "--api-key-file")
		})
	}
}

func TestParseConfigLimits(t *testing.T) {
	c, err := parseConfig(nil, noEnv, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, 120*time.Second, c.idleConnTimeout)
	assert.Equal(t, 60*time.Second, c.readBodyTimeout)
	assert.Equal(t, 256, c.maxTurns)
	assert.Equal(t, int64(256<<20), c.maxBufferedBytes)
	assert.Equal(t, 64<<10, c.maxHeaderBytes)
	assert.Equal(t, 60*time.Second, c.writeTimeout)
	assert.Equal(t, 4096, c.maxConns)
	assert.Equal(t, 512, c.maxTransit)
	assert.Equal(t, 32, c.maxClientTransit)
	assert.Equal(t, kvroute.Defaults().Limits.ObjectMembers, c.maxObjectMembers)

	for _, tt := range []struct {
		want string
		args []string
	}{
		{"--max-concurrent-turns", []string{"--max-concurrent-turns", "0"}},
		{"--max-buffered-bytes 1024 is below --max-body-bytes 2048", []string{"--max-body-bytes", "2048", "--max-buffered-bytes", "1024"}},
		{"--idle-conn-timeout", []string{"--idle-conn-timeout", "0s"}},
		{"--read-body-timeout", []string{"--read-body-timeout", "-1s"}},
		{"--max-header-bytes", []string{"--max-header-bytes", "100"}},
		{"--max-body-bytes", []string{"--max-body-bytes", "0"}},
		{"--client-write-timeout", []string{"--client-write-timeout", "-1s"}},
		{"--max-connections", []string{"--max-connections", "0"}},
		{"--max-bodies-in-transit", []string{"--max-bodies-in-transit", "0"}},
		{"--max-client-bodies-in-transit 600: use 0 (no bound per client) up to --max-bodies-in-transit 512", []string{"--max-client-bodies-in-transit", "600"}},
		{"--max-client-bodies-in-transit -1", []string{"--max-client-bodies-in-transit", "-1"}},
		{"--max-object-members", []string{"--max-object-members", "0"}},
	} {
		t.Run(tt.want, func(t *testing.T) {
			_, err := parseConfig(tt.args, noEnv, io.Discard)
			require.Error(t, err)
			assert.ErrorIs(t, err, errUsage)
			assert.Contains(t, err.Error(), tt.want)
		})
	}
}

// --decode-local and --kv-bytes-per-token reach the router's options.
func TestParseConfigDecodeLocal(t *testing.T) {
	base := []string{"--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2"}
	c, err := parseConfig(base, func(string) string { return "" }, io.Discard)
	require.NoError(t, err)
	assert.False(t, c.decodeLocal)
	n := len(c.routerOptions())
	c, err = parseConfig(append(base, "--decode-local", "--kv-bytes-per-token", "262144"), func(string) string { return "" }, io.Discard)
	require.NoError(t, err)
	assert.True(t, c.decodeLocal)
	assert.Equal(t, int64(262144), c.kvBytesPerToken)
	assert.Len(t, c.routerOptions(), n, "both ride on WithDecodeMemory, always given")
}

// A flag that names engines (or the address, the keys, the store), given
// with nothing in it, is refused: in a deployment that is an unset
// environment variable, and the default in its place (localhost engines,
// every interface, an open proxy) would run silently wrong.
func TestEmptyValuesRefused(t *testing.T) {
	for _, args := range [][]string{
		{"--prefill="},
		{"--decode="},
		{"--prefill", ""},
		{"--prefill", ","},
		{"--prefill", " , "},
		{"--prefill", "http://p:1,,http://p:2"},
		{"--decode", "http://d:1", ""},
		{"--prefiller-hosts", ""},
		{"--prefiller-hosts=", "--prefiller-ports", "8100"},
		{"--decoder-hosts", "d", "--decoder-ports", ""},
		{"--prefiller-port="},
		{"--prefill-dns", ""},
		{"--decode-dns="},
		{"--prefill-dns", "  "},
		{"--api-key", ""},
		{"--api-key="},
		{"--api-key-file", ""},
		{"--host", ""},
		{"--redis-url="},
	} {
		_, err := parseConfig(args, noEnv, io.Discard)
		if assert.Error(t, err, "%q", args) {
			assert.ErrorIs(t, err, errUsage, "%q", args)
			assert.Contains(t, err.Error(), "empty value (an unset environment variable?)", "%q", args)
		}
	}
	// Through the proxy's run: it stops at once with the error, serving
	// nothing (a cancelled context: had it started, it would stop at once).
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	var stdout syncBuffer
	err := run(ctx, []string{"--prefill=", "--decode", "http://127.0.0.1:1", "--host", "127.0.0.1", "--port", "0"}, noEnv, &stdout, io.Discard)
	require.ErrorIs(t, err, errUsage)
	assert.Contains(t, err.Error(), `invalid value "" for flag --prefill: empty value`)
	assert.NotContains(t, stdout.String(), "serving")
}
