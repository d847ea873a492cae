// Command bench is a multi-turn load generator for any OpenAI-compatible
// chat endpoint: a kvroute router, the proxy, or an engine directly.
//
//	go run ./examples/bench --url http://127.0.0.1:8000 --input conversations.json \
//	  --clients 8 --max-active 32 --request-rate 4 --output stats.json
//
// The input is one of vLLM's multi-turn benchmark inputs
// (benchmarks/multi_turn): a JSON list of conversations
// [{"id": ..., "messages": [{"role": ..., "content": ...}, ...]}], or a
// generate_conversations config with its distributions. Like vLLM's
// benchmark_serving_multi_turn.py, every turn sends the whole history with
// stream true, and the streamed reply is appended as the assistant message.
//
// It reports time to first token (to the first chunk with non-empty
// delta.content), time per output token (per content chunk after the
// first) and latency as percentiles, the reuse hit rate from the router's
// X-Bidikv-Reuse response header (when present), and writes per-request
// stats as JSON with --output. --send-conversation-id adds the body field
// conversation_id and the X-Session-ID header; --header adds any header.
//
// With --overhead it measures the router's own cost instead (overhead.go):
// run from the repository root, it builds and starts canned engines
// (vllmsim --canned) and proxies as separate processes and compares them
// with a direct P-then-D chain:
//
//	go run ./examples/bench --overhead [--hist 10KB,100KB] [--conc 1,64] [--modes content,tokens] [--repeats 3]
//
// With --replay-trace it replays a Mooncake conversation trace (by default
// the committed copy under testdata/mooncake) against decode-memory
// policies, without engines (replay.go): hold everything, drop the oldest
// hold over a cap, a shorter fixed TTL, and retention/budget's managed
// victims, at caps from 20% to 100% of holding everything's mean:
//
//	go run ./examples/bench --replay-trace [FILE] [--budgets 0.2,0.5,1] [--svg bidikv-replay.svg]
//
// With --fleet it runs hundreds of agent sessions through kvroute router
// replicas sharing one Store on simulated engines with KV capacity (prefix
// caching on, as vLLM's default), in modelled time on an event clock
// (fleet.go): unlimited memory, hold everything (every retained handle
// held on D for the TTL) and managed (kvroute.DecodeMemory's budget and
// releases) with the same sessions, with --replicas routers and with one,
// beside an offline bound on any release policy; it prints the decode
// memory targets as met / NOT MET lines (a wrong answer: exit status 1;
// a target not met too with --check):
//
//	go run ./examples/bench --fleet [--replicas 4] [--capacity half|ample|TOKENS] [--sessions 300] [--seed 1] [--svg fleet.svg] [--quick]
//
// bench --help lists the modes, one line each, and bench MODE --help a
// mode's flags. A run in which every request failed prints its first error
// and exits 1. Progress lines (one per interval in long runs) go to stderr
// only when it is a terminal; a redirected run writes its results only.
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
	stop()
	if err != nil && !errors.Is(err, flag.ErrHelp) {
		fmt.Fprintln(os.Stderr, "bench:", err)
		os.Exit(1)
	}
}
