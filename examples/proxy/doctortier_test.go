package main

import (
	"context"
	"encoding/json"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// tierDoctorJSON is --json's CPU-tier part.
type tierDoctorJSON struct {
	CPUTier []struct {
		Check, Severity, Seen, Fix string
	} `json:"cpu_tier"`
	Gaps []struct {
		Severity, What, Fix string
	}
	Works   bool `json:"reuse_works"`
	Verdict string
}

// failed returns the checks that are not ok, as "check: seen | fix" lines.
func (d tierDoctorJSON) failed() []string {
	var out []string
	for _, c := range d.CPUTier {
		if c.Severity != "ok" {
			out = append(out, c.Severity+" "+c.Check+": "+c.Seen+" | fix: "+c.Fix)
		}
	}
	return out
}

// tierEngines are a prefill and a decode engine in one side-channel
// registry, each with a CPU tier and the peer tier (P2P ports 5711 and
// 5710 on 127.0.0.1, the decode engine's HTTP host), KV bytes counted
// (1 KiB a token), as a correct deployment has them; p and d change it.
func tierEngines(t *testing.T, p, d func(*kvroutetest.CPUTier) []kvroutetest.Option) (pe, de *kvroutetest.Engine) {
	t.Helper()
	reg := kvroutetest.NewRegistry()
	mk := func(side, port int, change func(*kvroutetest.CPUTier) []kvroutetest.Option) *kvroutetest.Engine {
		tier := kvroutetest.CPUTier{Chunks: 4096, OffloadGenerated: true, HashSeed: "42", P2P: true, P2PPort: port}
		var extra []kvroutetest.Option
		if change != nil {
			extra = change(&tier)
		}
		opts := []kvroutetest.Option{kvroutetest.WithRegistry(reg), kvroutetest.WithSideChannel("127.0.0.1", side),
			kvroutetest.WithProfile(kvroutetest.Profile{KVBytesPerToken: 1024})}
		if tier.Chunks > 0 {
			opts = append(opts, kvroutetest.WithCPUTier(tier))
		}
		return kvroutetest.NewEngine(t, append(opts, extra...)...)
	}
	return mk(5600, 5711, p), mk(5601, 5710, d)
}

func tierDoctor(t *testing.T, p, d *kvroutetest.Engine, args ...string) (tierDoctorJSON, error, string) {
	t.Helper()
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	args = append([]string{"doctor", "--json", "--cpu-tier", "--prefill", p.URL(), "--decode", d.URL()}, args...)
	err := run(context.Background(), args, noEnv, stdout, stderr)
	var out tierDoctorJSON
	require.NoError(t, json.Unmarshal([]byte(stdout.String()), &out), "%s\n%s", stdout, stderr)
	return out, err, stdout.String()
}

// TestDoctorCPUTier: a correct tier passes every check, and each
// misconfiguration is named, with what was seen and its fix: the CPU tier
// checks are warnings (reuse through NIXL still works: exit 0), and
// --strict exits 1 on them.
func TestDoctorCPUTier(t *testing.T) {
	const gpu = 8192 * 16 // the engines' default KV pool
	twice := strconv.Itoa(2 * gpu)
	cases := []struct {
		name  string
		p, d  func(*kvroutetest.CPUTier) []kvroutetest.Option
		args  []string
		want  []string // substrings of the failed checks
		notOK []string // the checks that fail
		fail  bool     // reuse through NIXL fails too (exit 1)
	}{
		{name: "correct tier", args: []string{"--probe", "--cpu-tier-tokens", twice}},
		{name: "correct tier, no probe", args: []string{"--cpu-tier-tokens", twice},
			want:  []string{"not on /metrics: a wrong one makes every peer pull miss", "run the doctor with --probe --cpu-tier"},
			notOK: []string{"not exported"}},
		{name: "no connector on the decode engine", args: []string{"--probe", "--cpu-tier-tokens", twice},
			d: func(c *kvroutetest.CPUTier) []kvroutetest.Option { c.Chunks = 0; return nil },
			want: []string{"decode engine http://127.0.0.1:", "has no offloading connector (GET /metrics: no vllm:kv_offload_* series", "it serves its CPU tier to the prefill engines",
				`"kv_connector":"MultiConnector"`, `"offload_prompt_only":false,"secondary_tiers":[{"type":"p2p"}]`,
				"not run: the decode engine has no offloading connector"},
			notOK: []string{"connector", "peer pull"}},
		{name: "block size mismatch", args: []string{"--probe", "--cpu-tier-tokens", twice},
			p: func(*kvroutetest.CPUTier) []kvroutetest.Option {
				return []kvroutetest.Option{kvroutetest.WithBlockSize(32)}
			},
			want: []string{"the engines report different block sizes: 32 (prefill http://", "16 (decode http://", "fix: the same --block-size on every engine (--block-size 16)", "every peer pull missed"},
			// the static check names it, the pull shows it; NIXL reuse fails too
			notOK: []string{"block size", "peer pull"}, fail: true},
		{name: "hash algorithm mismatch", args: []string{"--probe", "--cpu-tier-tokens", twice},
			p:     func(c *kvroutetest.CPUTier) []kvroutetest.Option { c.HashAlgo = "xxhash"; return nil },
			want:  []string{"different hash algorithms: xxhash (prefill http://", "sha256 (decode http://", "--prefix-caching-hash-algo sha256", "every peer pull missed"},
			notOK: []string{"hash algorithm", "peer pull"}},
		{name: "hash seed mismatch", args: []string{"--probe", "--cpu-tier-tokens", twice},
			p: func(c *kvroutetest.CPUTier) []kvroutetest.Option { c.HashSeed = "7"; return nil },
			want: []string{"every peer pull missed: the decode engine stored about", "the prefill engine loaded none of them through remote_kv_source 127.0.0.1:5710",
				"one PYTHONHASHSEED on every engine", "VLLM_P2P_SIDE_CHANNEL_HOST its routable address, not localhost"},
			notOK: []string{"peer pull"}},
		{name: "wrong peer port", args: []string{"--probe", "--cpu-tier-tokens", twice, "--cpu-tier-port", "5799"},
			want:  []string{"every peer pull missed", "through remote_kv_source 127.0.0.1:5799", "port 5799 (--cpu-tier-port"},
			notOK: []string{"peer pull"}},
		{name: "peer tier named by --cpu-tier-peers", args: []string{"--probe", "--cpu-tier-tokens", twice, "--cpu-tier-peers", "{decode}=127.0.0.1:5799"},
			d: func(c *kvroutetest.CPUTier) []kvroutetest.Option { c.P2PPort = 5799; return nil }},
		{name: "wrong port in --cpu-tier-peers", args: []string{"--probe", "--cpu-tier-tokens", twice, "--cpu-tier-peers", "{decode}=127.0.0.1:5798"},
			d:     func(c *kvroutetest.CPUTier) []kvroutetest.Option { c.P2PPort = 5799; return nil },
			want:  []string{"every peer pull missed", "through remote_kv_source 127.0.0.1:5798", "port 5798 (--cpu-tier-peers"},
			notOK: []string{"peer pull"}},
		{name: "prompt-only decode engine", args: []string{"--probe", "--cpu-tier-tokens", twice},
			d: func(c *kvroutetest.CPUTier) []kvroutetest.Option { c.OffloadGenerated = false; return nil },
			want: []string{"prompt tokens through remote_kv_source 127.0.0.1:5710, none of the 65 generated ones: the decode engine stored none of its answer",
				`"offload_prompt_only": false in the decode engines' OffloadingConnector`},
			notOK: []string{"peer pull"}},
		{name: "prefix caching off on the prefill engine", args: []string{"--cpu-tier-tokens", twice},
			p: func(*kvroutetest.CPUTier) []kvroutetest.Option {
				return []kvroutetest.Option{kvroutetest.WithPrefixCaching(false)}
			},
			want:  []string{"prefix caching is off on prefill http://", "fix: start every engine without --no-enable-prefix-caching"},
			notOK: []string{"prefix caching", "not exported"}},
		{name: "capacity below the GPU KV", args: []string{"--probe", "--cpu-tier-tokens", "100000"},
			want:  []string{"CPU tier 100000 tokens (--cpu-tier-tokens), below its GPU KV capacity of 131072 tokens", "for at least 131072 tokens (llm-d's guide sizes the tier at about twice the GPU KV: 262144)"},
			notOK: []string{"capacity"}},
		{name: "capacity unknown", args: []string{"--probe"},
			want:  []string{"CPU tier capacity unknown: vLLM exports none (GPU KV: 131072 tokens)", "--cpu-tier-tokens <the tier's tokens per rank", "how the router will know the tier's size"},
			notOK: []string{"capacity"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			p, d := tierEngines(t, tc.p, tc.d)
			args := slices.Clone(tc.args)
			for i := range args {
				args[i] = strings.ReplaceAll(args[i], "{decode}", d.URL())
			}
			out, err, raw := tierDoctor(t, p, d, args...)
			if !tc.fail {
				require.NoError(t, err, "the tier's checks are warnings: reuse through NIXL works\n%s", raw)
				assert.True(t, out.Works)
			}
			failed := out.failed()
			var names []string
			for _, c := range out.CPUTier {
				if c.Severity != "ok" {
					names = append(names, c.Check)
				}
			}
			assert.Equal(t, tc.notOK, names, "%s", strings.Join(failed, "\n"))
			joined := strings.Join(failed, "\n")
			for _, w := range tc.want {
				assert.Contains(t, joined, w)
			}
			var gaps strings.Builder
			for _, g := range out.Gaps {
				gaps.WriteString(g.What + " | fix: " + g.Fix + "\n")
			}
			for _, c := range tc.notOK {
				assert.Contains(t, gaps.String(), "CPU tier, "+c+": ", "every failed check is a gap")
			}
			if len(tc.notOK) == 0 {
				assert.Contains(t, out.Verdict, "the CPU tier passes every check")
				// 135 prompt tokens, 65 generated; D stored the 12 whole blocks
				// of the 199 tokens it computed, P loaded them all
				assert.Contains(t, raw, "the prefill engine loaded about 192 of the 200 tokens of the prompt (135) and the answer (65)", "the pull's figures")
				return
			}
			_, err, _ = tierDoctor(t, p, d, append(args, "--strict")...)
			assert.ErrorIs(t, err, errNoReuse, "--strict: exit 1 on a tier gap")
		})
	}
}

// doctor --probe --cpu-tier against vllmsim processes started as vLLM
// would be: MultiConnector(NixlConnector, OffloadingConnector with a p2p
// tier) from --kv-transfer-config, PYTHONHASHSEED from the environment,
// the decode engine's peer port from its ready line. One seed pulls the
// prompt and the answer; two seeds miss every chunk; a decode engine
// without offload_prompt_only false keeps its answer off the tier.
func TestDoctorCPUTierVLLMSim(t *testing.T) {
	tierKV := func(promptOnly bool) string {
		return `{"kv_connector":"MultiConnector","kv_role":"kv_both","kv_connector_extra_config":{"connectors":[` +
			`{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true}},` +
			`{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",` +
			`"cpu_bytes_to_use":4294967296,"offload_prompt_only":` + strconv.FormatBool(promptOnly) + `,"secondary_tiers":[{"type":"p2p","port":0}]}}]}}`
	}
	p2p := regexp.MustCompile(` p2p \S+:(\d+)`)
	cases := []struct {
		name           string
		pSeed, dSeed   string
		dPromptOnly    bool
		severity, want string
	}{
		{name: "one seed", pSeed: "1", dSeed: "1", severity: "ok", want: "the prefill engine loaded about 192 of the 200 tokens of the prompt"},
		{name: "two seeds", pSeed: "1", dSeed: "2", severity: "warn", want: "every peer pull missed"},
		{name: "prompt-only decode engine", pSeed: "1", dSeed: "1", dPromptOnly: true, severity: "warn",
			want: "the decode engine stored none of its answer in its CPU tier"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			args := []string{"--port", "0", "--side-channel-port", "0", "--profile", "qwen3-32b"}
			p := startEnv(t, []string{"PYTHONHASHSEED=" + tc.pSeed}, "vllmsim", simReady, append(args, "--kv-transfer-config", tierKV(false))...)
			d := startEnv(t, []string{"PYTHONHASHSEED=" + tc.dSeed}, "vllmsim", simReady, append(args, "--kv-transfer-config", tierKV(tc.dPromptOnly))...)
			m := p2p.FindStringSubmatch(d.line)
			require.NotNil(t, m, d.line)
			stdout, stderr := &syncBuffer{}, &syncBuffer{}
			err := run(context.Background(), []string{"doctor", "--json", "--cpu-tier", "--probe", "--cpu-tier-port", m[1],
				"--prefill", p.url, "--decode", d.url}, noEnv, stdout, stderr)
			require.NoError(t, err, stdout.String())
			var out tierDoctorJSON
			require.NoError(t, json.Unmarshal([]byte(stdout.String()), &out), "%s\n%s", stdout, stderr)
			var pull []string
			for _, c := range out.CPUTier {
				if c.Check == "peer pull" {
					pull = append(pull, c.Severity+": "+c.Seen)
				}
			}
			require.Len(t, pull, 1, stdout.String())
			assert.True(t, strings.HasPrefix(pull[0], tc.severity+": "), pull[0])
			assert.Contains(t, pull[0], tc.want)
		})
	}
}
