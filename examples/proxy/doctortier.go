package main

import (
	"cmp"
	"flag"
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	"github.com/bidikv/bidikv/kvroute/capability"
)

// The doctor's CPU-tier checks (--cpu-tier): whether the decode engines'
// CPU tiers (vLLM's OffloadingConnector in a MultiConnector after the
// NixlConnector, with the peer tier of PR 48021) would serve peer pulls
// by the prefill engines, as docs/cpu-tier.md describes them, with the
// tier the proxy serves from (--cpu-tier-tokens, --cpu-tier-port,
// --cpu-tier-peers: cpuTier); these checks let an operator fix a
// deployment first. What /metrics shows is checked always (the connector,
// one block size, one hash algorithm, prefix caching, the capacity); what
// it does not (the hash seed, the offloaded chunk size,
// offload_prompt_only, the peer port) only a pull can show: --probe runs
// one (doctortierprobe.go).

// tierOptions are the doctor's CPU-tier options: --cpu-tier, and the tier
// as the proxy's flags give it (cpuTier, memory.go), which runDoctor copies
// from the configuration.
type tierOptions struct {
	on bool
	cpuTier
}

func (o *tierOptions) flags(fs *flag.FlagSet) {
	fs.BoolVar(&o.on, "cpu-tier", false, "also check the decode engines' CPU tier (OffloadingConnector with a p2p tier) for peer pulls by the prefill engines; with --probe, pull once")
}

// tierCheck is one line of the doctor's CPU-tier section: what was seen,
// and the fix when it is not ok.
type tierCheck struct {
	check    string // connector, block size, hash algorithm, prefix caching, capacity, not exported, peer pull
	severity string // tierOK, gapNote or gapWarn
	seen     string
	fix      string
}

// tierOK is the severity of a passed check.
const tierOK = "ok"

// fixTierConnector is the kv-transfer-config that gives an engine of role
// the CPU tier with the peer tier (docs/cpu-tier.md, sections 1 to 3): its
// role's NIXL configuration first (capability.KVTransferPrefill or
// KVTransferDecode, as docs/engines.md gives them), then the
// OffloadingConnector with TieringOffloadingSpec and a p2p tier.
func fixTierConnector(role string) string {
	nixl := capability.KVTransferPrefill
	if role == roleDecode {
		nixl = capability.KVTransferDecode
	}
	return `start the ` + role + ` engine with --kv-transfer-config '{"kv_connector":"MultiConnector","kv_role":"kv_both",` +
		`"kv_connector_extra_config":{"connectors":[` + nixl + `,` +
		`{"kv_connector":"OffloadingConnector","kv_role":"kv_both","kv_connector_extra_config":{"spec_name":"TieringOffloadingSpec",` +
		`"cpu_bytes_to_use":<bytes, about twice the GPU KV>,"offload_prompt_only":false,"secondary_tiers":[{"type":"p2p"}]}}]}}' ` +
		`and the same PYTHONHASHSEED on every engine (a routable VLLM_P2P_SIDE_CHANNEL_HOST across hosts)`
}

// tierChecks are the checks of what the engines' /metrics show.
func (o tierOptions) tierChecks(engines []engineFacts) []tierCheck {
	var up []engineFacts
	for _, e := range engines {
		if e.rep != nil && e.rep.Reachable {
			up = append(up, e)
		}
	}
	if len(up) == 0 {
		return []tierCheck{{check: "connector", severity: gapWarn, seen: "no engine answered: nothing to check",
			fix: "check the addresses and that the engines are up"}}
	}
	out := connectorChecks(up)
	out = append(out, agreement(up, "block size", func(r *capability.Report) string {
		if r.BlockSize > 0 {
			return strconv.Itoa(r.BlockSize)
		}
		return ""
	}, "peer lookups miss every chunk: chunk keys chain over the GPU block size, and the peer tier's handshake rejects a block_len mismatch",
		"the same --block-size on every engine (--block-size %s)"))
	out = append(out, agreement(up, "hash algorithm", func(r *capability.Report) string { return r.HashAlgo },
		"peer lookups miss every chunk: chunk keys are block hashes of that algorithm",
		"the same --prefix-caching-hash-algo on every engine (--prefix-caching-hash-algo %s)"))
	out = append(out, prefixCachingCheck(up))
	out = append(out, o.capacityChecks(up)...)
	return out
}

// connectorChecks: every engine needs the offloading connector, decode
// engines to serve their tier, prefill engines to pull through theirs.
// It is seen by its vllm:kv_offload_* series on /metrics.
func connectorChecks(up []engineFacts) []tierCheck {
	var out []tierCheck
	var have []string
	for _, e := range up {
		f := e.rep.KVOffload
		why := "it serves its CPU tier to the prefill engines"
		if e.role == rolePrefill {
			why = "it pulls from the decode engines' CPU tiers through its own"
		}
		switch f.State {
		case capability.Present:
			have = append(have, e.role+" "+e.url)
		case capability.Absent:
			out = append(out, tierCheck{check: "connector", severity: gapWarn,
				seen: fmt.Sprintf("%s engine %s has no offloading connector (%s), and %s", e.role, e.url, f.Why, why),
				fix:  fixTierConnector(e.role)})
		default:
			out = append(out, tierCheck{check: "connector", severity: gapNote,
				seen: fmt.Sprintf("%s engine %s: offloading connector unknown (%s)", e.role, e.url, cmp.Or(f.Why, "/metrics not read")),
				fix:  "serve /metrics (no --disable-log-stats): the vllm:kv_offload_* series show the connector"})
		}
	}
	if len(out) == 0 {
		out = append(out, tierCheck{check: "connector", severity: tierOK,
			seen: "every engine exports vllm:kv_offload_* (an offloading connector is loaded): " + strings.Join(have, ", ")})
	}
	return out
}

// agreement checks that every engine reports the same value of one
// cache_config_info label; fix is a format taking the decode engines'
// (else the most common) value.
func agreement(up []engineFacts, name string, value func(*capability.Report) string, cost, fix string) tierCheck {
	byValue := map[string][]string{}
	var values, silent []string
	pick := ""
	for _, e := range up {
		v := value(e.rep)
		if v == "" {
			silent = append(silent, e.role+" "+e.url)
			continue
		}
		if _, ok := byValue[v]; !ok {
			values = append(values, v)
		}
		byValue[v] = append(byValue[v], e.role+" "+e.url)
		if e.role == roleDecode && pick == "" {
			pick = v
		}
	}
	switch {
	case len(values) > 1:
		var parts []string
		for _, v := range values {
			parts = append(parts, fmt.Sprintf("%s (%s)", v, strings.Join(byValue[v], ", ")))
		}
		if pick == "" { // no decode engine reports one: the most common
			pick = slices.MaxFunc(values, func(a, b string) int { return len(byValue[a]) - len(byValue[b]) })
		}
		return tierCheck{check: name, severity: gapWarn,
			seen: fmt.Sprintf("the engines report different %ss: %s: %s", name, strings.Join(parts, ", "), cost),
			fix:  fmt.Sprintf(fix, pick)}
	case len(silent) > 0:
		return tierCheck{check: name, severity: gapNote,
			seen: fmt.Sprintf("%s unknown on %s (vllm:cache_config_info does not report it)%s", name, strings.Join(silent, ", "), sameAs(values)),
			fix:  "check it by hand, or run with --probe: a peer pull tests it"}
	}
	return tierCheck{check: name, severity: tierOK, seen: fmt.Sprintf("every engine reports %s %s", name, values[0])}
}

func sameAs(values []string) string {
	if len(values) == 1 {
		return "; the others report " + values[0]
	}
	return ""
}

// prefixCachingCheck: loaded chunks become prefix-cache blocks, and the
// chunk keys are prefix-cache block hashes.
func prefixCachingCheck(up []engineFacts) tierCheck {
	var off, unknownOn []string
	for _, e := range up {
		switch e.rep.PrefixCaching.State {
		case capability.Absent:
			off = append(off, e.role+" "+e.url)
		case capability.Present:
		default:
			unknownOn = append(unknownOn, e.role+" "+e.url)
		}
	}
	switch {
	case len(off) > 0:
		return tierCheck{check: "prefix caching", severity: gapWarn,
			seen: "prefix caching is off on " + strings.Join(off, ", ") + ": the CPU tier keys chunks by prefix-cache block hashes and loads them as prefix-cache hits",
			fix:  "start every engine without --no-enable-prefix-caching"}
	case len(unknownOn) > 0:
		return tierCheck{check: "prefix caching", severity: gapNote,
			seen: "prefix caching unknown on " + strings.Join(unknownOn, ", ") + " (no enable_prefix_caching in vllm:cache_config_info)",
			fix:  "check that no engine runs with --no-enable-prefix-caching"}
	}
	return tierCheck{check: "prefix caching", severity: tierOK, seen: "prefix caching is on on every engine"}
}

// capacityChecks weigh --cpu-tier-tokens against each decode engine's GPU
// KV capacity (vllm:cache_config_info: num_gpu_blocks × block_size, per
// data-parallel rank). llm-d's guide sizes the tier at about twice the GPU
// KV: a smaller one mostly duplicates blocks still on the GPU.
func (o tierOptions) capacityChecks(up []engineFacts) []tierCheck {
	var out []tierCheck
	for _, e := range up {
		if e.role != roleDecode {
			continue
		}
		gpu := e.rep.KVCacheTokens
		switch {
		case o.tokens <= 0:
			out = append(out, tierCheck{check: "capacity", severity: gapNote,
				seen: fmt.Sprintf("decode engine %s: CPU tier capacity unknown: vLLM exports none (GPU KV: %s)", e.url, tokensOr(gpu)),
				fix:  fmt.Sprintf("--cpu-tier-tokens <the tier's tokens per rank: cpu_bytes_to_use over the KV bytes per token> (about %s: twice the GPU KV); it is how the router will know the tier's size", tokensOr(2*gpu))})
		case gpu <= 0:
			out = append(out, tierCheck{check: "capacity", severity: gapNote,
				seen: fmt.Sprintf("decode engine %s: --cpu-tier-tokens %d, GPU KV capacity unknown (%s)", e.url, o.tokens, e.rep.Metrics.Why),
				fix:  "serve vllm:cache_config_info on /metrics (no --disable-log-stats) so the tier can be weighed against the GPU KV"})
		case o.tokens < gpu:
			out = append(out, tierCheck{check: "capacity", severity: gapWarn,
				seen: fmt.Sprintf("decode engine %s: CPU tier %d tokens (--cpu-tier-tokens), below its GPU KV capacity of %d tokens: the tier mostly duplicates blocks still on the GPU, and history is evicted from it before the GPU releases it", e.url, o.tokens, gpu),
				fix:  fmt.Sprintf("a larger cpu_bytes_to_use on the decode engines, for at least %d tokens (llm-d's guide sizes the tier at about twice the GPU KV: %d), and --cpu-tier-tokens to match", gpu, 2*gpu)})
		default:
			out = append(out, tierCheck{check: "capacity", severity: tierOK,
				seen: fmt.Sprintf("decode engine %s: CPU tier %d tokens, %.1fx its GPU KV capacity of %d tokens", e.url, o.tokens, float64(o.tokens)/float64(gpu), gpu)})
		}
	}
	return out
}

func tokensOr(n int64) string {
	if n <= 0 {
		return "unknown"
	}
	return strconv.FormatInt(n, 10) + " tokens"
}

// notExported is the note a run without --probe ends on: what /metrics
// cannot show is checked by a pull only.
var notExported = tierCheck{check: "not exported", severity: gapNote,
	seen: "the hash seed (PYTHONHASHSEED), the offloaded chunk size, offload_prompt_only and the peer port are not on /metrics: a wrong one makes every peer pull miss, silently",
	fix:  "run the doctor with --probe --cpu-tier: it pulls a decode engine's answer from its CPU tier into a prefill engine"}

// addTier puts the CPU-tier checks in the report: each one not ok is a
// gap too (so --strict exits 1 on it), and the verdict says how many.
func (d *diagnosis) addTier(checks []tierCheck) {
	d.tier = checks
	bad := 0
	for _, c := range checks {
		if c.severity == tierOK {
			continue
		}
		d.gaps = append(d.gaps, gap{severity: c.severity, what: "CPU tier, " + c.check + ": " + c.seen, fix: c.fix})
		if c.severity == gapWarn {
			bad++
		}
	}
	switch {
	case len(checks) == 0:
	case bad == 0:
		d.verdict += "; the CPU tier passes every check"
	default:
		d.verdict += fmt.Sprintf("; the CPU tier fails %s (see its fixes)", plural(bad, "check"))
	}
}

// writeTier prints the CPU-tier section.
func (d *diagnosis) writeTier(w io.Writer, port int) {
	if len(d.tier) == 0 {
		return
	}
	fmt.Fprintf(w, "\nCPU tier (--cpu-tier: peer pulls from the decode engines' CPU tiers, port %d)\n", port)
	for _, c := range d.tier {
		fmt.Fprintf(w, "  %-4s  %s: %s\n", c.severity, c.check, printable(c.seen))
		if c.fix != "" {
			fmt.Fprintf(w, "        fix: %s\n", printable(c.fix))
		}
	}
}

// tierJSON is one CPU-tier check in --json.
type tierJSON struct {
	Check    string `json:"check"`
	Severity string `json:"severity"`
	Seen     string `json:"seen"`
	Fix      string `json:"fix,omitempty"`
}

func (d *diagnosis) tierJSON() []tierJSON {
	var out []tierJSON
	for _, c := range d.tier {
		out = append(out, tierJSON{c.check, c.severity, c.seen, c.fix})
	}
	return out
}
