package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"slices"
	"time"

	"github.com/bidikv/bidikv/internal/sim"
	"github.com/bidikv/bidikv/internal/toytok"
)

// options are the parsed command line.
type options struct {
	host, sideHost string
	port, sidePort int
	cfg            sim.Config
	verbose        bool
	offload        offloadConfig // a MultiConnector's OffloadingConnector child
	canned         string        // "prefill" or "decode": canned.go's fixed answers
	cannedBlocks   int           // --num-gpu-blocks-override for a canned engine (0: toytok.PoolBlocks)
	warnings       []string
}

// kvTransferConfig is the part of vLLM's --kv-transfer-config the simulator
// reads (vllm/config/kv_transfer.py, KVTransferConfig). The connector's
// settings are read where vLLM reads them: bidirectional_kv_xfer,
// kv_recompute_threshold, decoder_kv_blocks_ttl and kv_lease_duration from
// kv_connector_extra_config only (get_from_extra_config in
// nixl/base_scheduler.py, NixlBaseConnectorScheduler.__init__);
// kv_load_failure_policy, engine_id, kv_connector and kv_role at the top
// level only.
type kvTransferConfig struct {
	KVConnector *string `json:"kv_connector"`
	KVRole      *string `json:"kv_role"`
	// EngineID is vLLM's engine_id: fixed, it survives a restart.
	EngineID            string      `json:"engine_id"`
	KVLoadFailurePolicy *string     `json:"kv_load_failure_policy"`
	Extra               extraConfig `json:"kv_connector_extra_config"`
}

// extraConfig is the NixlConnector's part of kv_connector_extra_config.
type extraConfig struct {
	Bidirectional      *bool    `json:"bidirectional_kv_xfer"`
	RecomputeThreshold *int     `json:"kv_recompute_threshold"`
	DecoderBlocksTTL   *float64 `json:"decoder_kv_blocks_ttl"`
	LeaseDuration      *float64 `json:"kv_lease_duration"`
}

// kvRoles are KVTransferConfig's kv_role values.
var kvRoles = []string{"kv_producer", "kv_consumer", "kv_both"}

// parseKVTransferConfig reads --kv-transfer-config raw into c with vLLM's
// defaults for whatever it leaves out: bidirectional_kv_xfer false,
// kv_recompute_threshold 64 (with --decode-recompute, vLLM PR #55801: 0
// without bidirectional transfer), decoder_kv_blocks_ttl 480 s,
// kv_lease_duration 30 s
// (NixlBaseConnectorScheduler.__init__), kv_load_failure_policy "fail"
// (KVTransferConfig). A kv_connector without a kv_role is refused, as
// KVTransferConfig.__post_init__ refuses it; the simulator models only the
// NixlConnector. Settings vLLM reads only from kv_connector_extra_config
// are ignored at the top level, as vLLM ignores them; each is reported in
// the returned warnings.
func parseKVTransferConfig(raw string, c *sim.Config, off *offloadConfig) (warnings []string, err error) {
	var k kvTransferConfig
	if err := json.Unmarshal([]byte(raw), &k); err != nil {
		return nil, fmt.Errorf("--kv-transfer-config: %w", err)
	}
	var top, extra map[string]json.RawMessage
	_ = json.Unmarshal([]byte(raw), &top)
	_ = json.Unmarshal(top["kv_connector_extra_config"], &extra)
	if k.KVConnector != nil && *k.KVConnector == "MultiConnector" && off != nil {
		// MultiConnector(NixlConnector, OffloadingConnector): the NIXL
		// child's settings as a plain NIXL config's; engine_id and
		// kv_load_failure_policy from the top level (MultiConnector passes
		// its engine_id to the children; the scheduler reads the policy
		// from the top-level config)
		nixl, o, err := parseMultiConnector(extra)
		if err != nil {
			return nil, err
		}
		if warnings, err = parseKVTransferConfig(string(nixl), c, nil); err != nil {
			return nil, err
		}
		*off = o
		c.EngineID = k.EngineID
		c.KVLoadFailurePolicy = sim.PolicyFail
		if k.KVLoadFailurePolicy != nil {
			c.KVLoadFailurePolicy = *k.KVLoadFailurePolicy
		}
		return warnings, nil
	}
	switch {
	case k.KVConnector == nil:
		return nil, errors.New("--kv-transfer-config: kv_connector is not set (the simulator models the NixlConnector)")
	case *k.KVConnector != "NixlConnector":
		return nil, fmt.Errorf("--kv-transfer-config: kv_connector %q: the simulator models only the NixlConnector", *k.KVConnector)
	case k.KVRole == nil:
		return nil, fmt.Errorf("--kv-transfer-config: Please specify kv_role when kv_connector is set, supported roles are %q (vLLM's KVTransferConfig)", kvRoles)
	case !slices.Contains(kvRoles, *k.KVRole):
		return nil, fmt.Errorf("--kv-transfer-config: Unsupported kv_role: %s. Supported roles are %q", *k.KVRole, kvRoles)
	}
	c.NoKVConnector = false
	c.EngineID = k.EngineID
	c.Bidirectional = k.Extra.Bidirectional != nil && *k.Extra.Bidirectional
	c.RecomputeThreshold = 64
	if c.DecodeRecompute && !c.Bidirectional {
		// PR #55801, which guards D's pulls too, keeps them unguarded by
		// default without bidirectional transfer
		c.RecomputeThreshold = 0
	}
	if k.Extra.RecomputeThreshold != nil {
		c.RecomputeThreshold = *k.Extra.RecomputeThreshold
	}
	c.DecoderBlocksTTL = 480 * time.Second
	if k.Extra.DecoderBlocksTTL != nil {
		c.DecoderBlocksTTL = seconds(*k.Extra.DecoderBlocksTTL)
	}
	c.LeaseDuration = 30 * time.Second
	if k.Extra.LeaseDuration != nil {
		c.LeaseDuration = seconds(*k.Extra.LeaseDuration)
	}
	c.KVLoadFailurePolicy = sim.PolicyFail
	if k.KVLoadFailurePolicy != nil {
		c.KVLoadFailurePolicy = *k.KVLoadFailurePolicy
	}
	for _, key := range []string{"bidirectional_kv_xfer", "kv_recompute_threshold", "decoder_kv_blocks_ttl", "kv_lease_duration"} {
		if _, ok := top[key]; ok {
			warnings = append(warnings, fmt.Sprintf("--kv-transfer-config: %s at the top level is ignored, as vLLM ignores it: put it in kv_connector_extra_config", key))
		}
	}
	if _, ok := extra["kv_load_failure_policy"]; ok {
		warnings = append(warnings, "--kv-transfer-config: kv_load_failure_policy in kv_connector_extra_config is ignored, as vLLM ignores it: put it at the top level")
	}
	return warnings, nil
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

// parseFlags reads the command line; --help writes its text to help and
// returns flag.ErrHelp.
func parseFlags(args []string, help io.Writer) (*options, error) {
	return parseFlagsWith(args, help, nil)
}

// parseFlagsWith is parseFlags; seen, if not nil, gets the flag set once
// every flag is defined (the tests read it).
func parseFlagsWith(args []string, help io.Writer, seen func(*flag.FlagSet)) (*options, error) {
	o := &options{cfg: sim.DefaultConfig()}
	// vLLM without --kv-transfer-config: no KV connector at all
	o.cfg.NoKVConnector, o.cfg.Bidirectional, o.cfg.RecomputeThreshold = true, false, 0
	fs := flag.NewFlagSet("vllmsim", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	fs.StringVar(&o.host, "host", "127.0.0.1", "address to serve the OpenAI API on")
	fs.IntVar(&o.port, "port", 8000, "port to serve the OpenAI API on (0: any)")
	fs.StringVar(&o.cfg.Model, "model", o.cfg.Model, "served model name")
	fs.StringVar(&o.cfg.Model, "served-model-name", o.cfg.Model, "alias of --model")
	fs.StringVar(&o.cfg.CPUTier.HashAlgo, "prefix-caching-hash-algo", sim.HashSHA256, "prefix-cache block hash: sha256 or xxhash (with the CPU tier: keys agree across engines only with one algorithm and one PYTHONHASHSEED, read from the environment)")
	kvc := fs.String("kv-transfer-config", "", `vLLM KV transfer config JSON: kv_connector "NixlConnector", kv_role, engine_id, kv_load_failure_policy (default fail), kv_connector_extra_config {bidirectional_kv_xfer (default false), kv_recompute_threshold (default 64), decoder_kv_blocks_ttl (480), kv_lease_duration (30)}; or kv_connector "MultiConnector" with kv_connector_extra_config.connectors [that NIXL config, an "OffloadingConnector" config whose kv_connector_extra_config has cpu_bytes_to_use (needs --profile) or num_cpu_blocks, block_size or blocks_per_chunk, offload_prompt_only (default true), and with spec_name "TieringOffloadingSpec" secondary_tiers [{"type": "p2p", "port": 5710}]]: the CPU tier (default: none, no KV connector: kv_transfer_params are ignored)`)
	noCache := fs.Bool("no-enable-prefix-caching", false, "disable prefix caching")
	fs.IntVar(&o.cfg.BlockSize, "block-size", o.cfg.BlockSize, "KV block size in tokens")
	gpuBlocks := fs.Int("num-gpu-blocks-override", 0, "num_gpu_blocks: the KV pool's blocks per data-parallel rank, vLLM's null block included, so one fewer usable (default: the --profile's capacity on one 8xH200 node, else 8193; with --canned, at least 100000: the pool the canned engine reports)")
	fs.IntVar(&o.cfg.MaxNumSeqs, "max-num-seqs", o.cfg.MaxNumSeqs, "requests a rank runs at once; the others wait (0: no limit)")
	fs.StringVar(&o.cfg.Version, "sim-version", o.cfg.Version, "the vLLM version GET /version reports (empty: no /version route, 404)")
	noTokenize := fs.Bool("no-tokenize", false, "no POST /tokenize route (404), as a server without it")
	noResponsesKV := fs.Bool("no-responses-kv-transfer", false, "an engine before vLLM PR #37424: /v1/responses ignores kv_transfer_params and returns none")
	noMessagesKV := fs.Bool("no-messages-kv-transfer", false, "an engine before vLLM PR #37535: /v1/messages ignores kv_transfer_params and returns none")
	fs.StringVar(&o.cfg.UsageMetric, "kv-usage-metric", sim.UsageMetricCurrent, "KV usage gauge on /metrics: current (vllm:kv_cache_usage_perc), legacy (vllm:gpu_cache_usage_perc, before vLLM 0.9) or both (0.9, 0.10)")
	fs.IntVar(&o.cfg.TPSize, "tensor-parallel-size", o.cfg.TPSize, "tp_size put in handles")
	profile := fs.String("profile", "", "cost profile: qwen3-32b or glm-5-fp8 (default: zero cost)")
	fs.Float64Var(&o.cfg.Speed, "speed", 0, "sleep modelled time / speed in real time (0: never sleep)")
	fs.BoolVar(&o.cfg.StreamHandles, "stream-handles", false, "put kv_transfer_params on the final stream chunk (vLLM PR #40186), and on response.completed of /v1/responses streams")
	fs.BoolVar(&o.cfg.Reasoning, "reasoning", false, "start replies with reasoning, returned in the reasoning field (see --reasoning-field)")
	fs.BoolVar(&o.cfg.InlineReasoning, "inline-reasoning", false, "with --reasoning: no reasoning parser, the think block stays in the content")
	fs.StringVar(&o.cfg.ReasoningField, "reasoning-field", o.cfg.ReasoningField, "reasoning key of messages and deltas: reasoning, reasoning_content or both")
	fs.BoolVar(&o.cfg.PrefillHandleOnLengthOnly, "prefill-handle-on-length-only", false, "older engines: P emits its handle only on the length cap, not on a stop")
	fs.BoolVar(&o.cfg.DecodeRecompute, "decode-recompute", false, "kv_recompute_threshold guards D's pull too (vLLM PR #55801): D computes short prompts locally")
	fs.IntVar(&o.cfg.KVGroups, "kv-groups", 1, "number of KV-cache groups (one block-id list each in handles)")
	fs.IntVar(&o.cfg.GroupBlockSize, "kv-group-block-size", 0, "hybrid model: block size of the KV groups after the first, a multiple of --block-size, as vLLM gives a group of smaller pages (0: --block-size)")
	fs.IntVar(&o.cfg.SlidingWindow, "sliding-window", 0, "hybrid model: the KV groups after the first hold sliding-window layers of this many tokens, and handles carry only their in-window tail (0: full attention)")
	fs.Float64Var(&o.cfg.DriftRate, "drift-rate", 0, "probability per reply of a non-canonical token split (BPE drift), 0 to 1")
	fs.Float64Var(&o.cfg.ToolCallRate, "tool-call-rate", o.cfg.ToolCallRate, "probability per reply under tool_choice auto (the default with tools) that the reply ends in a tool call, as a model served with --enable-auto-tool-choice (0 to 1; 0: never)")
	fs.StringVar(&o.cfg.Template, "template", o.cfg.Template, "chat template family: chatml (Qwen3-like) or llama3 (trims content)")
	fs.StringVar(&o.cfg.ContentFormat, "chat-template-content-format", o.cfg.ContentFormat, "how text parts reach the template: string (joined with newlines) or openai (concatenated)")
	fs.StringVar(&o.cfg.Render, "render-api", sim.RenderEnabled, "render endpoints /v1/chat/completions/render, /v1/completions/render, /v1/responses/render and /v1/messages/render: enabled, disabled (501 NotImplementedError, no renderer) or absent (404, an engine older than the render API)")
	fs.IntVar(&o.cfg.DPSize, "data-parallel-size", o.cfg.DPSize, "data-parallel ranks, each with its own engine id (<id>_dp<k>), KV pool and side channel at --side-channel-port + k; X-data-parallel-rank pins a request")
	fs.BoolVar(&o.cfg.PromptTokensDetails, "enable-prompt-tokens-details", false, "usage carries prompt_tokens_details.cached_tokens: the prompt tokens not computed (prefix-cache hits, pulled, loaded from a CPU tier), as vLLM's flag")
	fs.BoolVar(&o.cfg.StrictRank, "strict-rank", false, "with one data-parallel rank, reject X-data-parallel-rank other than 0 as vLLM does (default: ignore the header)")
	fs.StringVar(&o.cfg.Fingerprint, "fingerprint-mode", sim.FingerprintAbsent, "system_fingerprint: full (vLLM's default), hash, custom (--fingerprint-value), none (null) or absent (no key, engines before the fingerprint)")
	fs.StringVar(&o.cfg.FingerprintValue, "fingerprint-value", "", "system_fingerprint with --fingerprint-mode custom")
	fs.StringVar(&o.sideHost, "side-channel-host", "127.0.0.1", "side-channel host (VLLM_NIXL_SIDE_CHANNEL_HOST), also put in handles")
	fs.IntVar(&o.sidePort, "side-channel-port", 5600, "side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT) of data-parallel rank 0; rank k listens on it + k (0: any free run of ports)")
	fs.BoolVar(&o.verbose, "verbose", false, "log engine events to stderr")
	fs.StringVar(&o.canned, "canned", "", "for router overhead runs only: prefill or decode, answer at once with fixed bytes and a toy tokenizer, simulating nothing (no KV, no side channel; see examples/bench --overhead); handles hold one block id per --block-size tokens in each of --kv-groups lists, as vLLM's do")
	if seen != nil {
		seen(fs)
	}
	if err := fs.Parse(args); err != nil {
		return nil, flagError(fs, err, help)
	}
	switch fs.NArg() {
	case 0:
	case 1: // vllm serve MODEL
		o.cfg.Model = fs.Arg(0)
	default:
		return nil, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	o.cfg.PrefixCaching = !*noCache
	o.cfg.NoTokenize, o.cfg.NoResponsesKV, o.cfg.NoMessagesKV = *noTokenize, *noResponsesKV, *noMessagesKV
	if *kvc != "" {
		warnings, err := parseKVTransferConfig(*kvc, &o.cfg, &o.offload)
		if err != nil {
			return nil, err
		}
		o.warnings = warnings
	}
	if o.canned != "" && o.canned != "prefill" && o.canned != "decode" {
		return nil, fmt.Errorf("--canned %q: use prefill or decode", o.canned)
	}
	if o.cfg.DPSize < 1 {
		return nil, fmt.Errorf("--data-parallel-size %d: must be at least 1", o.cfg.DPSize)
	}
	if *profile != "" {
		p, ok := sim.LookupProfile(*profile)
		if !ok {
			return nil, fmt.Errorf("--profile %q: unknown (known: %v)", *profile, sim.ProfileNames())
		}
		o.cfg.Profile = p
		if n := p.NumGPUBlocks(o.cfg.BlockSize); n > 0 {
			o.cfg.NumBlocks = n
		}
	}
	if err := o.offload.cpuTier(&o.cfg); err != nil {
		return nil, err
	}
	switch {
	case *gpuBlocks == 1 || *gpuBlocks < 0:
		return nil, fmt.Errorf("--num-gpu-blocks-override %d: must be at least 2 (block 0 is vLLM's null block)", *gpuBlocks)
	case *gpuBlocks > 1 && o.canned != "" && *gpuBlocks < toytok.PoolBlocks:
		return nil, fmt.Errorf("--num-gpu-blocks-override %d with --canned: must be at least %d (the canned handles' block ids are below it)", *gpuBlocks, toytok.PoolBlocks)
	case *gpuBlocks > 1:
		o.cfg.NumBlocks = *gpuBlocks - 1
		o.cannedBlocks = *gpuBlocks
	}
	return o, nil
}
