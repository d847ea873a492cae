package main

import (
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"time"

	"github.com/bidikv/bidikv/internal/sim"
)

// options are the parsed command line.
type options struct {
	host, sideHost string
	port, sidePort int
	cfg            sim.Config
	verbose        bool
	canned         string // "prefill" or "decode": canned.go's fixed answers
}

// kvTransferConfig is the part of vLLM's --kv-transfer-config the simulator
// reads. The engine settings may sit at the top level or in
// kv_connector_extra_config; the latter wins.
type kvTransferConfig struct {
	KVConnector string `json:"kv_connector"`
	KVRole      string `json:"kv_role"`
	// EngineID is vLLM's engine_id: fixed, it survives a restart.
	EngineID string `json:"engine_id"`
	engineKnobs
	Extra engineKnobs `json:"kv_connector_extra_config"`
}

type engineKnobs struct {
	Bidirectional       *bool    `json:"bidirectional_kv_xfer"`
	RecomputeThreshold  *int     `json:"kv_recompute_threshold"`
	DecoderBlocksTTL    *float64 `json:"decoder_kv_blocks_ttl"`
	LeaseDuration       *float64 `json:"kv_lease_duration"`
	KVLoadFailurePolicy *string  `json:"kv_load_failure_policy"`
}

func (k engineKnobs) apply(c *sim.Config) {
	if k.Bidirectional != nil {
		c.Bidirectional = *k.Bidirectional
	}
	if k.RecomputeThreshold != nil {
		c.RecomputeThreshold = *k.RecomputeThreshold
	}
	if k.DecoderBlocksTTL != nil {
		c.DecoderBlocksTTL = seconds(*k.DecoderBlocksTTL)
	}
	if k.LeaseDuration != nil {
		c.LeaseDuration = seconds(*k.LeaseDuration)
	}
	if k.KVLoadFailurePolicy != nil {
		c.KVLoadFailurePolicy = *k.KVLoadFailurePolicy
	}
}

func seconds(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }

func parseFlags(args []string, stderr io.Writer) (*options, error) {
	o := &options{cfg: sim.DefaultConfig()}
	fs := flag.NewFlagSet("vllmsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.StringVar(&o.host, "host", "127.0.0.1", "address to serve the OpenAI API on")
	fs.IntVar(&o.port, "port", 8000, "port to serve the OpenAI API on (0: any)")
	fs.StringVar(&o.cfg.Model, "model", o.cfg.Model, "served model name")
	fs.StringVar(&o.cfg.Model, "served-model-name", o.cfg.Model, "alias of --model")
	kvc := fs.String("kv-transfer-config", "", "vLLM KV transfer config JSON (engine_id, bidirectional_kv_xfer, kv_recompute_threshold, decoder_kv_blocks_ttl, kv_lease_duration, kv_load_failure_policy)")
	noCache := fs.Bool("no-enable-prefix-caching", false, "disable prefix caching")
	fs.IntVar(&o.cfg.BlockSize, "block-size", o.cfg.BlockSize, "KV block size in tokens")
	gpuBlocks := fs.Int("num-gpu-blocks-override", 0, "num_gpu_blocks: the KV pool's blocks per data-parallel rank, vLLM's null block included, so one fewer usable (default: the --profile's capacity on one 8xH200 node, else 8193)")
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
	fs.BoolVar(&o.cfg.DecodeRecompute, "decode-recompute", false, "kv_recompute_threshold guards D's pull too (current vLLM): D computes short prompts locally")
	fs.IntVar(&o.cfg.KVGroups, "kv-groups", 1, "number of KV-cache groups (one block-id list each in handles)")
	fs.Float64Var(&o.cfg.DriftRate, "drift-rate", 0, "probability per reply of a non-canonical token split (BPE drift), 0 to 1")
	fs.Float64Var(&o.cfg.ToolCallRate, "tool-call-rate", o.cfg.ToolCallRate, "probability per reply under tool_choice auto (the default with tools) that the reply ends in a tool call, as a model served with --enable-auto-tool-choice (0 to 1; 0: never)")
	fs.StringVar(&o.cfg.Template, "template", o.cfg.Template, "chat template family: chatml (Qwen3-like) or llama3 (trims content)")
	fs.StringVar(&o.cfg.ContentFormat, "chat-template-content-format", o.cfg.ContentFormat, "how text parts reach the template: string (joined with newlines) or openai (concatenated)")
	fs.StringVar(&o.cfg.Render, "render-api", sim.RenderEnabled, "render endpoints /v1/chat/completions/render, /v1/completions/render, /v1/responses/render and /v1/messages/render: enabled, disabled (501 NotImplementedError, no renderer) or absent (404, an engine older than the render API)")
	fs.IntVar(&o.cfg.DPSize, "data-parallel-size", o.cfg.DPSize, "data-parallel ranks, each with its own engine id (<id>_dp<k>), KV pool and side channel at --side-channel-port + k; X-data-parallel-rank pins a request")
	fs.BoolVar(&o.cfg.StrictRank, "strict-rank", false, "with one data-parallel rank, reject X-data-parallel-rank other than 0 as vLLM does (default: ignore the header)")
	fs.StringVar(&o.cfg.Fingerprint, "fingerprint-mode", sim.FingerprintAbsent, "system_fingerprint: full (vLLM's default), hash, custom (--fingerprint-value), none (null) or absent (no key, engines before the fingerprint)")
	fs.StringVar(&o.cfg.FingerprintValue, "fingerprint-value", "", "system_fingerprint with --fingerprint-mode custom")
	fs.StringVar(&o.sideHost, "side-channel-host", "127.0.0.1", "side-channel host (VLLM_NIXL_SIDE_CHANNEL_HOST), also put in handles")
	fs.IntVar(&o.sidePort, "side-channel-port", 5600, "side-channel port (VLLM_NIXL_SIDE_CHANNEL_PORT) of data-parallel rank 0; rank k listens on it + k (0: any free run of ports)")
	fs.BoolVar(&o.verbose, "verbose", false, "log engine events to stderr")
	fs.StringVar(&o.canned, "canned", "", "for router overhead runs only: prefill or decode, answer at once with fixed bytes and a toy tokenizer, simulating nothing (no KV, no side channel; see examples/bench --overhead); handles hold one block id per --block-size tokens in each of --kv-groups lists, as vLLM's do")
	if err := fs.Parse(args); err != nil {
		return nil, err
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
		var k kvTransferConfig
		if err := json.Unmarshal([]byte(*kvc), &k); err != nil {
			return nil, fmt.Errorf("--kv-transfer-config: %w", err)
		}
		o.cfg.EngineID = k.EngineID
		k.engineKnobs.apply(&o.cfg)
		k.Extra.apply(&o.cfg)
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
	switch {
	case *gpuBlocks == 1 || *gpuBlocks < 0:
		return nil, fmt.Errorf("--num-gpu-blocks-override %d: must be at least 2 (block 0 is vLLM's null block)", *gpuBlocks)
	case *gpuBlocks > 1:
		o.cfg.NumBlocks = *gpuBlocks - 1
	}
	return o, nil
}
