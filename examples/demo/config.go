package main

import (
	"errors"
	"flag"
	"fmt"
	"io"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// config is what one demo run does.
type config struct {
	profile       kvroutetest.Profile
	conversations int     // conversations per mode
	turns         int     // turns per conversation
	startTokens   int     // prompt tokens of the first turn
	endTokens     int     // prompt tokens of the last turn
	replyTokens   int     // max_tokens of each reply
	concurrency   int     // conversations in flight at once
	seed          uint64  // seed of the conversation text
	svg           string  // chart path, "" for none
	progress      bool    // progress bar on stderr
	kvBytes       float64 // bytes of KV per token (0: unknown), for "KV held"
}

// kvBytesPerToken is the size of one token's KV cache in bf16 for the
// profiled models, where the architecture makes it simple:
// qwen3-32b has 64 layers × 8 KV heads × 128 dims × (K,V) × 2 bytes.
var kvBytesPerToken = map[string]float64{
	"qwen3-32b": 64 * 8 * 128 * 2 * 2,
}

// endTokensFor is the longest prompt of the published experiment per model.
var endTokensFor = map[string]int{
	"qwen3-32b": 24000,
	"glm-5-fp8": 20000,
}

func parseFlags(args []string, stderr io.Writer) (config, error) {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(stderr)
	name := fs.String("profile", "qwen3-32b", "cost profile: qwen3-32b or glm-5-fp8")
	convs := fs.Int("conversations", 16, "conversations per mode")
	turns := fs.Int("turns", 12, "turns per conversation")
	end := fs.Int("max-tokens", 0, "prompt tokens of the last turn (0: 24000 for qwen3-32b, 20000 for glm-5-fp8)")
	conc := fs.Int("concurrency", 4, "conversations in flight at once")
	seed := fs.Uint64("seed", 1, "seed of the generated conversations")
	svg := fs.String("svg", "bidikv-demo.svg", "write the chart here (empty: no chart)")
	quiet := fs.Bool("quiet", false, "no progress bar on stderr")
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	p, ok := kvroutetest.LookupProfile(*name)
	if !ok {
		return config{}, fmt.Errorf("unknown profile %q (want qwen3-32b or glm-5-fp8)", *name)
	}
	c := config{
		profile:       p,
		conversations: *convs,
		turns:         *turns,
		startTokens:   2000,
		endTokens:     *end,
		replyTokens:   48,
		concurrency:   *conc,
		seed:          *seed,
		svg:           *svg,
		progress:      !*quiet,
		kvBytes:       kvBytesPerToken[p.Name],
	}
	if c.endTokens == 0 {
		c.endTokens = endTokensFor[p.Name]
	}
	return c, c.validate()
}

func (c config) validate() error {
	switch {
	case c.conversations < 1:
		return errors.New("--conversations must be at least 1")
	case c.turns < 2:
		return errors.New("--turns must be at least 2")
	case c.concurrency < 1:
		return errors.New("--concurrency must be at least 1")
	case c.endTokens <= c.startTokens+c.turns*(c.replyTokens+64):
		return fmt.Errorf("--max-tokens %d leaves too little room for %d turns", c.endTokens, c.turns)
	}
	return nil
}
