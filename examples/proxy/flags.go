package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"regexp"
	"strconv"
	"strings"

	"github.com/bidikv/bidikv/internal/cli"
)

// synopsis opens `bidikv-proxy --help`.
const synopsis = `Usage: bidikv-proxy [flags]
       bidikv-proxy doctor [flags] [--probe]

bidikv-proxy routes multi-turn conversations over vLLM prefill (P) and decode
(D) engines with bidirectional KV transfer: a turn's prefill pulls the KV the
decode engine kept from the turn before instead of recomputing the history,
after proving by tokens that it is the prompt's own prefix. It takes the
command line of vLLM's disagg_proxy_multiturn.py, serves POST
/v1/chat/completions, /v1/completions, /v1/responses and /v1/messages, and
/health, /ready and /metrics. "bidikv-proxy doctor" checks these flags against
the engines and names the fix for every gap.
`

// helpGroups lists the flags of --help by group, in order; a flag's
// aliases follow it after a comma. Every flag is in exactly one group
// (TestHelpListsEveryFlagOnce).
var helpGroups = []struct {
	title string
	flags []string
}{
	{"Engines", []string{"prefill", "decode", "prefiller-hosts,prefiller-host", "prefiller-ports,prefiller-port",
		"decoder-hosts,decoder-host", "decoder-ports,decoder-port", "prefill-dns", "decode-dns", "dns-refresh",
		"prefill-dp-size", "decode-dp-size", "health-interval", "health-timeout", "session-affinity", "session-headers"}},
	{"Reuse and verification", []string{"reuse", "verification", "key-mode", "block-size", "recompute-threshold",
		"retention-ttl", "decoder-kv-blocks-ttl", "decode-local", "decode-stream", "local-prefill-fallback", "restart-check",
		"render-timeout", "kv-bytes-per-token"}},
	{"Decode memory", []string{"decode-memory-budget", "decode-memory-headroom", "decode-memory-room-rate", "decode-kv-capacity", "decode-high-watermark",
		"decode-metrics-interval", "decode-memory-releases", "decode-memory-journal",
		"cpu-tier-tokens", "cpu-tier-port", "cpu-tier-peers", "cpu-tier-prompt-only", "cpu-tier-first"}},
	{"Limits", []string{"max-body-bytes", "max-buffered-bytes", "max-object-members", "max-header-bytes",
		"max-concurrent-turns", "max-connections", "max-bodies-in-transit", "max-client-bodies-in-transit", "min-body-rate"}},
	{"Timeouts", []string{"prefill-timeout", "first-byte-timeout", "idle-timeout", "buffered-timeout", "read-header-timeout",
		"read-body-timeout", "client-write-timeout", "idle-conn-timeout", "shutdown-grace"}},
	{"Observability", []string{"log-level", "log-format", "metrics-require-key", "debug-addr", "debug-allow-remote"}},
	{"Deployment", []string{"host", "port", "api-key", "api-key-file", "allow-anonymous-conversation-id",
		"redis-url", "redis-wait-replicas"}},
	{"Doctor", []string{"probe", "json", "strict", "probe-engine-timeout", "probe-timeout", "probe-max-tokens", "cpu-tier"}},
}

// positiveDurations are the duration flags whose 0 means nothing: they
// take a positive value. Every other duration flag's 0 means none (no
// bound, no reads, at once); no duration flag takes a negative value
// (durflag.Check, TestDurationFlags).
var positiveDurations = []string{
	"retention-ttl", "decoder-kv-blocks-ttl", "render-timeout", "read-header-timeout", "idle-conn-timeout",
	"read-body-timeout", "health-interval", "health-timeout", "dns-refresh", "probe-engine-timeout", "probe-timeout",
}

// writeHelp writes the synopsis and fs's flags by group, each flag once
// with its aliases.
func writeHelp(w io.Writer, fs *flag.FlagSet, head string) {
	groups := make([]cli.Group, len(helpGroups))
	for i, g := range helpGroups {
		groups[i] = cli.Group{Title: g.title, Flags: g.flags}
	}
	cli.WriteHelp(w, fs, head, groups, flagValue)
}

// listValues names the values of the flags that take several.
var listValues = map[string]string{
	"prefill": "URL...", "decode": "URL...", "prefiller-hosts": "HOST...", "prefiller-host": "HOST...",
	"decoder-hosts": "HOST...", "decoder-host": "HOST...", "prefiller-ports": "PORT...", "prefiller-port": "PORT...",
	"decoder-ports": "PORT...", "decoder-port": "PORT...", "api-key": "KEY...",
}

// flagValue names a flag's value in --help: SIZE for sizes, the list
// flags' own names; "" for the flag package's.
func flagValue(f *flag.Flag) string {
	switch f.Value.(type) {
	case byteSize, intBytes:
		return "SIZE"
	case *listFlag:
		return listValues[f.Name]
	case *tierPeers:
		return "URL=HOST:PORT,..."
	}
	return ""
}

// byteSize is a flag of a size in bytes: a number of bytes, or a number
// with a unit (KiB, MiB, GiB, TiB: powers of 1024; kB, MB, GB, TB: powers
// of 1000; B), as 32MiB. It prints in the largest binary unit that
// divides it.
type byteSize struct{ v *int64 }

func (b byteSize) String() string {
	if b.v == nil {
		return ""
	}
	return formatBytes(*b.v)
}

// Set parses s.
func (b byteSize) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	*b.v = n
	return nil
}

var byteUnits = map[string]float64{
	"": 1, "b": 1,
	"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
	"kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12,
}

var byteRE = regexp.MustCompile(`^\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*$`)

// parseBytes reads a size as byteSize.Set does.
func parseBytes(s string) (int64, error) {
	m := byteRE.FindStringSubmatch(s)
	if m == nil {
		return 0, errors.New("not a size: use bytes, or a number with KiB, MiB, GiB (or kB, MB, GB), as 32MiB")
	}
	unit, ok := byteUnits[strings.ToLower(m[2])]
	if !ok {
		return 0, fmt.Errorf("unknown unit %q: use B, KiB, MiB, GiB, TiB, kB, MB, GB or TB", m[2])
	}
	f, err := strconv.ParseFloat(m[1], 64)
	if err != nil {
		return 0, err
	}
	v := f * unit
	if v > math.MaxInt64/2 || v != math.Trunc(v) {
		return 0, errors.New("not a whole number of bytes below 4 EiB")
	}
	return int64(v), nil
}

// formatBytes writes n in the largest binary unit that divides it.
func formatBytes(n int64) string {
	for _, u := range []struct {
		name string
		size int64
	}{{"TiB", 1 << 40}, {"GiB", 1 << 30}, {"MiB", 1 << 20}, {"KiB", 1 << 10}} {
		if n != 0 && n%u.size == 0 {
			return strconv.FormatInt(n/u.size, 10) + u.name
		}
	}
	return strconv.FormatInt(n, 10)
}

// intBytes adapts an int field to byteSize.
type intBytes struct{ v *int }

func (b intBytes) String() string {
	if b.v == nil {
		return ""
	}
	return formatBytes(int64(*b.v))
}

func (b intBytes) Set(s string) error {
	n, err := parseBytes(s)
	if err != nil {
		return err
	}
	if n > math.MaxInt32 {
		return errors.New("too large")
	}
	*b.v = int(n)
	return nil
}

// parseError turns the flag package's message into one line that names
// the flag as it is written (--name) and, for an unknown flag, the
// closest known one.
func parseError(fs *flag.FlagSet, err error) error {
	if name, ok := cli.UnknownFlag(err); ok {
		hint := ""
		if s := cli.Closest(fs, name); s != "" {
			hint = " (did you mean --" + s + "?)"
		}
		return fmt.Errorf("%w: unknown flag --%s%s; %s --help lists the flags", errUsage, name, hint, fs.Name())
	}
	// invalid value "x" for flag -port: parse error
	msg := regexp.MustCompile(`flag -([a-z])`).ReplaceAllString(err.Error(), "flag --$1")
	msg = strings.Replace(msg, "flag needs an argument: -", "flag needs an argument: --", 1)
	return fmt.Errorf("%w: %s", errUsage, msg)
}

// optionFlags names the flag behind each kvroute option the proxy sets, so
// that a configuration error names the flag, not the library option. A
// grouped option's fields are keyed "WithGroup.Field"; kvroute's errors
// name them "WithGroup: Field ..." and may name a sibling field bare.
var optionFlags = map[string]string{
	"WithTTLs.Retention": "--retention-ttl", "WithTTLs.DecoderBlocks": "--decoder-kv-blocks-ttl",
	"WithThreshold": "--recompute-threshold", "WithReuse": "--reuse",
	"WithFailover.LocalPrefill": "--local-prefill-fallback",
	"WithLimits.Body":           "--max-body-bytes", "WithLimits.ObjectMembers": "--max-object-members",
	"WithTimeouts.Prefill": "--prefill-timeout", "WithTimeouts.FirstByte": "--first-byte-timeout",
	"WithTimeouts.Idle": "--idle-timeout", "WithTimeouts.Render": "--render-timeout",
	"WithVerification": "--verification", "WithVerification.Mode": "--verification",
	"WithVerification.BlockSize": "--block-size", "WithHealth.RestartCheck": "--restart-check",
	"WithDecodeMemory.CPUTierTokens": "--cpu-tier-tokens", "WithDecodeMemory.CPUTierPort": "--cpu-tier-port",
	"WithDecodeMemory.CPUTierPeers": "--cpu-tier-peers",
	"WithDecodeMemory.Local":        "--decode-local", "WithDecodeMemory.KVBytesPerToken": "--kv-bytes-per-token",
	"WithPrefill": "--prefill", "WithDecode": "--decode", "WithEndpoints": "--prefill/--decode",
	"WithUpstreamAPIKey": "OPENAI_API_KEY", "WithIdentifier": "--key-mode",
}

var (
	groupFieldRE = regexp.MustCompile(`\b(With[A-Z][A-Za-z]*): ([A-Z][A-Za-z]*)\b ?`)
	optionRE     = regexp.MustCompile(`\bWith[A-Z][A-Za-z]*\b`)
	fieldRE      = regexp.MustCompile(`\b[A-Z][A-Za-z]*\b`)
)

// flagError rewrites a kvroute configuration error in the proxy's terms:
// each option or option field named becomes its flag ("kvroute: invalid
// configuration: WithTTLs: Retention 10m0s leaves ... (or raise
// DecoderBlocks ...)" becomes "--retention-ttl: 10m0s leaves ... (or raise
// --decoder-kv-blocks-ttl ...)"). It wraps errUsage.
func flagError(err error) error {
	msg := err.Error()
	msg = strings.ReplaceAll(msg, "kvroute: invalid configuration: ", "")
	msg = strings.ReplaceAll(msg, "kvroute: invalid config: ", "")
	group := ""
	msg = groupFieldRE.ReplaceAllStringFunc(msg, func(m string) string {
		sub := groupFieldRE.FindStringSubmatch(m)
		if f, ok := optionFlags[sub[1]+"."+sub[2]]; ok {
			group = sub[1]
			return f + ": "
		}
		return m
	})
	msg = optionRE.ReplaceAllStringFunc(msg, func(opt string) string {
		if f, ok := optionFlags[opt]; ok {
			return f
		}
		return opt
	})
	if group != "" { // a sibling field named bare, as in "(or raise DecoderBlocks ...)"
		msg = fieldRE.ReplaceAllStringFunc(msg, func(field string) string {
			if f, ok := optionFlags[group+"."+field]; ok {
				return f
			}
			return field
		})
	}
	return fmt.Errorf("%w: %s", errUsage, msg)
}
