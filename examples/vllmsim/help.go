package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/bidikv/bidikv/internal/cli"
)

// synopsis opens `vllmsim --help`.
const synopsis = `Usage: vllmsim [flags] [MODEL]

vllmsim is one simulated vLLM engine, no GPU: vLLM's OpenAI API (chat,
completions, responses, messages, their render routes, /tokenize), its
--kv-transfer-config, real KV handles and token ids over a side channel, KV
capacity enforced as vLLM's scheduler does, /metrics and /version. Without
--profile it models no compute (every answer at once); --profile qwen3-32b or
glm-5-fp8 models the engine's times, and --speed 1 sleeps them in real time.
`

// helpGroups lists vllmsim's flags by group in --help; an alias follows
// its flag after a comma. Every flag is in exactly one group
// (TestHelpListsEveryFlagOnce).
var helpGroups = []cli.Group{
	{Title: "Serving", Flags: []string{"host", "port", "model,served-model-name", "side-channel-host", "side-channel-port",
		"data-parallel-size", "strict-rank", "tensor-parallel-size", "verbose"}},
	{Title: "KV cache and transfer", Flags: []string{"kv-transfer-config", "block-size", "prefix-caching-hash-algo", "kv-groups", "kv-group-block-size", "sliding-window", "num-gpu-blocks-override",
		"max-num-seqs", "no-enable-prefix-caching", "decode-recompute", "prefill-handle-on-length-only"}},
	{Title: "Cost model", Flags: []string{"profile", "speed"}},
	{Title: "Model and answers", Flags: []string{"template", "chat-template-content-format", "reasoning", "inline-reasoning",
		"reasoning-field", "tool-call-rate", "drift-rate"}},
	{Title: "What the engine offers (vLLM versions and PRs)", Flags: []string{"sim-version", "render-api", "stream-handles", "enable-prompt-tokens-details",
		"no-tokenize", "no-responses-kv-transfer", "no-messages-kv-transfer", "kv-usage-metric", "fingerprint-mode",
		"fingerprint-value"}},
	{Title: "Router overhead runs", Flags: []string{"canned"}},
}

// errUsage marks a command line vllmsim cannot run with (exit status 2).
var errUsage = errors.New("invalid command line")

// flagError is fs.Parse's error for the user: --help's text written to
// help (the error is then flag.ErrHelp), an unknown flag named with the
// nearest known one, and any other message with the flag as written.
func flagError(fs *flag.FlagSet, err error, help io.Writer) error {
	if errors.Is(err, flag.ErrHelp) {
		cli.WriteHelp(help, fs, synopsis, helpGroups, func(f *flag.Flag) string {
			if f.Name == "kv-transfer-config" {
				return "JSON"
			}
			return ""
		})
		return err
	}
	if name, ok := cli.UnknownFlag(err); ok {
		hint := ""
		if s := cli.Closest(fs, name); s != "" {
			hint = " (did you mean --" + s + "?)"
		}
		return fmt.Errorf("%w: unknown flag --%s%s; vllmsim --help lists the flags", errUsage, name, hint)
	}
	return fmt.Errorf("%w: %v", errUsage, err)
}
