// Command demo shows, on a laptop with no GPU, what bidirectional KV reuse
// does to time to first token in prefill/decode disaggregation.
//
//	go run ./examples/demo                      # qwen3-32b profile
//	go run ./examples/demo --profile glm-5-fp8  # the larger model
//	go run ./examples/demo --reasoning          # replies with <think>…</think>
//	go run ./examples/demo --suffix-tokens 300  # short tool results: decode-local turns
//	go run ./examples/demo --pause 300s,460s    # think time across the retention TTL
//
// It starts one simulated prefill engine (prefix caching off, as in the
// published experiment) and one simulated decode engine in process, and
// runs the same agent-style conversations twice through a kvroute.Router:
// once with reuse off (one-way P→D: every turn recomputes the whole history)
// and once with reuse on (each turn's prefill pulls the KV the decode engine
// kept from the turn before). A conversation's prompt grows by a constant
// factor a turn, from just under 2k tokens to 24k (20k for glm-5-fp8), in 12
// turns (19 for glm-5-fp8): the shape that fits the published results (see
// internal/sim/cost.go).
//
// With --reasoning every reply starts with reasoning that the chat template
// drops from past turns, as Qwen3's does. The router's default token
// verification then reuses the prefix the template kept; content
// verification (--verification content) reuses nothing.
//
// With --suffix-tokens N every turn after the first adds N new tokens (a
// tool result) to a long history, and --decode-local (default on) lets the
// router's cost model (threshold.CostModel) answer a turn on the decode
// engine that holds the conversation, as a plain request computing only
// the suffix; --decode-local=false restores the pull path. --pause adds a
// reuse-on run per think time, on a virtual clock that the engines' TTL and
// the router's retention follow.
//
// The engines do not sleep: the time they would take on GPUs is modelled
// from their request records with the profile's cost model (calibrated on the
// published 1P1D results), and so is the render call of token verification;
// the router's own overhead is measured in real time and added unscaled. The
// tables and the SVG chart label which figures are modelled.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	err := runMain(ctx, os.Args[1:], os.Stdout, os.Stderr)
	if errors.Is(err, flag.ErrHelp) {
		return
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "demo:", err)
		stop()
		os.Exit(1)
	}
}
