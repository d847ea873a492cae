// Command proxy is a drop-in replacement for vLLM's
// disagg_proxy_multiturn.py: it takes the same command line and serves the
// same routes, and routes multi-turn conversations over prefill and decode
// engines with bidirectional KV reuse through kvroute. It adds what a
// production service needs: inbound API keys, body, header and connection
// limits with load shedding, per-phase timeouts, /ready, Prometheus
// /metrics, structured logs with request ids, errors in OpenAI's JSON shape
// and a graceful drain on SIGTERM. See README.md.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Getenv, os.Stdout, os.Stderr)
	stop()
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		if errors.Is(err, errUsage) {
			os.Exit(2)
		}
		os.Exit(1)
	}
}
