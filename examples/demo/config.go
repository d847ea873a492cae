package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// config is what one demo run does.
type config struct {
	profile       kvroutetest.Profile
	conversations int     // conversations per mode
	turns         int     // turns per conversation
	startTokens   int     // prompt tokens of the second turn, the first that can hit
	endTokens     int     // prompt tokens of the last turn
	replyTokens   int     // max_tokens of each reply
	concurrency   int     // conversations in flight at once
	seed          uint64  // seed of the conversation text
	svg           string  // chart path, "" for none
	progress      bool    // progress bar on stderr
	kvBytes       float64 // bytes of KV per token (0: unknown), for "KV held"
	// capacity is the KV capacity of the profile's decode node, in tokens
	// (kvroutetest.Profile.KVCapacityTokens; 0: unknown), which the peak
	// KV held on decode is reported against
	capacity     int
	reasoning    bool // replies carry reasoning the template strips from history
	verification kvroute.VerificationMode
	published    []published // the profile's calibration points, if any
	suffixTokens int         // > 0: each later turn adds this many new tokens (a tool result)
	decodeLocal  bool        // with suffixTokens: the router may answer a turn on D alone
	pauses       []time.Duration
	pauseJitter  float64 // think time is uniform in pause × [1-j, 1+j]
}

// replyGrowth is what a turn's reply adds to the next prompt, in tokens,
// on average (the reply and its template), for the suffix-mode schedule.
const replyGrowth = 16

// localMode reports whether the router may run decode-local turns.
func (c config) localMode() bool { return c.suffixTokens > 0 && c.decodeLocal }

// published is one calibration point of the published 1P1D results, in ms.
type published struct {
	tokens                       int
	off, on, prefillOn, transfer float64
}

// profileDefaults is what the demo runs per profile: the longest prompt of
// the published experiment, the turns whose constant growth from 2k fits the
// published figures best (see internal/sim/cost.go), the KV size of one
// token in bf16 where the architecture makes it simple (qwen3-32b: 64
// layers × 8 KV heads × 128 dims × (K,V) × 2 bytes), and the published
// points.
func profileDefaults(name string) (end, turns int, kvBytes float64, pub []published) {
	switch name {
	case "qwen3-32b":
		return 24000, 12, 64 * 8 * 128 * 2 * 2, []published{
			{2000, 158, 122, 128, 30},
			{24000, 778, 460, 414, 130},
		}
	case "glm-5-fp8":
		return 20000, 19, 0, []published{
			{2000, 500, 358, 316, 29},
			{20000, 2334, 702, 541, 110},
		}
	}
	return 24000, 12, 0, nil
}

// description opens --help.
const description = `Usage: go run ./examples/demo [flags]

The demo shows, with no GPU, what bidirectional KV reuse does to time to first
token in prefill/decode disaggregation. It starts one simulated prefill engine
(prefix caching off, as in the published experiment) and one simulated decode
engine in process, and runs the same agent-style conversations twice through a
kvroute.Router: reuse off (every turn recomputes the whole history) and reuse
on (each turn's prefill pulls the KV the decode engine kept from the turn
before). Engine times are modelled from a cost profile calibrated on the
published 1P1D results; the router's own overhead is measured. It prints the
tables and writes an SVG chart (--svg).

Flags:
`

// parseFlags reads the command line; help receives --help's text (the
// error is then flag.ErrHelp).
func parseFlags(args []string, help io.Writer) (config, error) {
	fs := flag.NewFlagSet("demo", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	name := fs.String("profile", "qwen3-32b", "cost profile: qwen3-32b or glm-5-fp8")
	convs := fs.Int("conversations", 16, "conversations per mode")
	turns := fs.Int("turns", 0, "turns per conversation (0: 12 for qwen3-32b, 19 for glm-5-fp8, the shapes that fit the published results)")
	end := fs.Int("max-tokens", 0, "prompt tokens of the last turn (0: 24000 for qwen3-32b, 20000 for glm-5-fp8)")
	conc := fs.Int("concurrency", 4, "conversations in flight at once")
	seed := fs.Uint64("seed", 1, "seed of the generated conversations")
	svg := fs.String("svg", "bidikv-demo.svg", "write the chart here (empty: no chart)")
	quiet := fs.Bool("quiet", false, "no progress bar on stderr (drawn only when stderr is a terminal)")
	reasoning := fs.Bool("reasoning", false, "replies start with <think>…</think>, which the chat template drops from past turns (as Qwen3's does)")
	verify := fs.String("verification", "", "router verification mode: tokens or content (empty: the router's default)")
	suffix := fs.Int("suffix-tokens", 0, "each turn after the first adds this many new tokens, as a tool result would (0: the published shape, a constant growth factor)")
	pause := fs.String("pause", "", "comma-separated think times between turns (e.g. 60s,300s,440s,460s,600s): one more reuse-on run per value, on a virtual clock, printing hit rate, TTFT and KV held on D as the pause crosses the retention TTL")
	jitter := fs.Float64("pause-jitter", 0.02, "think time is uniform in pause×[1-j, 1+j]")
	local := fs.Bool("decode-local", true, "with --suffix-tokens, let the router answer a turn on the decode engine that holds the conversation when its cost model says so (=false: today's path, every hit pulls)")

	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(help, description)
			fs.SetOutput(help)
			fs.PrintDefaults()
			return config{}, err
		}
		return config{}, fmt.Errorf("%v; go run ./examples/demo --help lists the flags", err)
	}
	if fs.NArg() > 0 {
		return config{}, fmt.Errorf("unexpected argument %q", fs.Arg(0))
	}
	p, ok := kvroutetest.LookupProfile(*name)
	if !ok {
		return config{}, fmt.Errorf("unknown profile %q (want qwen3-32b or glm-5-fp8)", *name)
	}
	defEnd, defTurns, kvBytes, pub := profileDefaults(p.Name)
	if p.KVBytesPerToken > 0 {
		kvBytes = float64(p.KVBytesPerToken)
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
		kvBytes:       kvBytes,
		capacity:      p.KVCapacityTokens,
		reasoning:     *reasoning,
		verification:  kvroute.VerificationMode(*verify),
		published:     pub,
		suffixTokens:  *suffix,
		decodeLocal:   *local,
		pauseJitter:   *jitter,
	}
	if *pause != "" {
		for _, f := range strings.Split(*pause, ",") {
			d, err := time.ParseDuration(strings.TrimSpace(f))
			if err != nil || d < 0 {
				return config{}, fmt.Errorf("--pause %q: want durations such as 300s", f)
			}
			c.pauses = append(c.pauses, d)
		}
	}
	if c.endTokens == 0 {
		c.endTokens = defEnd
	}
	if c.turns == 0 {
		c.turns = defTurns
	}
	if c.suffixTokens > 0 {
		c.published = nil // a different shape from the published experiment's
		if *turns == 0 {
			// As many turns as fit between the first prompt and the last.
			c.turns = min(defTurns, 1+(c.endTokens-c.startTokens)/(c.suffixTokens+replyGrowth))
		}
	}
	return c, c.validate()
}

// growth is the factor by which the prompt grows each turn: from
// startTokens at the second turn to endTokens at the last.
func (c config) growth() float64 {
	return math.Pow(float64(c.endTokens)/float64(c.startTokens), 1/float64(c.turns-2))
}

// nominal is the prompt length turn t aims at, before jitter. With
// --suffix-tokens the first turn is long and each later one adds the
// suffix and the reply before it.
func (c config) nominal(t int) int {
	if c.suffixTokens > 0 {
		return c.endTokens - (c.turns-1-t)*(c.suffixTokens+replyGrowth)
	}
	if t == c.turns-1 {
		return c.endTokens
	}
	return int(math.Round(float64(c.startTokens) * math.Pow(c.growth(), float64(t-1))))
}

func (c config) validate() error {
	switch {
	case c.conversations < 1:
		return errors.New("--conversations must be at least 1")
	case c.turns < 3:
		return errors.New("--turns must be at least 3")
	case c.concurrency < 1:
		return errors.New("--concurrency must be at least 1")
	case c.verification != "" && c.verification != kvroute.VerifyTokens && c.verification != kvroute.VerifyContent:
		return fmt.Errorf("--verification %q: want tokens or content", c.verification)
	case c.endTokens <= c.startTokens:
		return fmt.Errorf("--max-tokens %d must exceed %d", c.endTokens, c.startTokens)
	case c.pauseJitter < 0 || c.pauseJitter >= 1:
		return errors.New("--pause-jitter must be in [0, 1)")
	case c.suffixTokens < 0:
		return errors.New("--suffix-tokens must not be negative")
	case c.suffixTokens > 0 && c.nominal(0) < 256:
		return fmt.Errorf("--suffix-tokens %d: %d turns do not fit under --max-tokens %d; use fewer --turns",
			c.suffixTokens, c.turns, c.endTokens)
	case c.suffixTokens > 0:
		return nil
	case float64(c.startTokens)*(1-1/c.growth()) < float64(2*(c.replyTokens+64)):
		return fmt.Errorf("--max-tokens %d leaves too little room for %d turns: each turn must add at least %d tokens",
			c.endTokens, c.turns, 2*(c.replyTokens+64))
	}
	return nil
}
