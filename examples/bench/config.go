package main

import (
	"errors"
	"fmt"
	"io"
	"net/http"
	"strings"
	"time"

	"github.com/bidikv/bidikv/internal/durflag"
)

type config struct {
	url        string
	input      string
	model      string
	clients    int
	maxActive  int
	rate       float64
	maxTurns   int
	maxTokens  int
	limit      int
	sendConvID bool
	header     http.Header
	output     string
	seed       uint64
	timeout    time.Duration
}

type headerFlag struct{ h http.Header }

func (f headerFlag) String() string { return "" }

func (f headerFlag) Set(s string) error {
	k, v, ok := strings.Cut(s, ":")
	if !ok || strings.TrimSpace(k) == "" {
		return fmt.Errorf("header %q: want \"Name: value\"", s)
	}
	f.h.Add(strings.TrimSpace(k), strings.TrimSpace(v))
	return nil
}

// parseFlags reads the default mode's command line; --help writes its
// text to help.
func parseFlags(args []string, help io.Writer) (config, error) {
	c := config{header: http.Header{}}
	fs := newFlagSet("bench")
	fs.StringVar(&c.url, "url", "http://127.0.0.1:8000", "base URL of the OpenAI-compatible server")
	fs.StringVar(&c.input, "input", "", "conversation list JSON or generate_conversations config (required)")
	fs.StringVar(&c.model, "model", "sim-model", "model name sent in every request")
	fs.IntVar(&c.clients, "clients", 1, "concurrent clients (N)")
	fs.IntVar(&c.maxActive, "max-active", 0, "active conversations at once (M; 0: as many as clients)")
	fs.Float64Var(&c.rate, "request-rate", 0, "requests per second over all clients, Poisson arrivals (0: as fast as possible)")
	fs.IntVar(&c.maxTurns, "max-turns", 0, "user turns per conversation at most (0: all)")
	fs.IntVar(&c.maxTokens, "max-tokens", 128, "max_tokens per turn when the input does not set it")
	fs.IntVar(&c.limit, "limit", 0, "conversations to run at most (0: all)")
	fs.BoolVar(&c.sendConvID, "send-conversation-id", false, "send conversation_id in the body and X-Session-ID")
	fs.Var(headerFlag{c.header}, "header", "extra request header \"Name: value\" (repeatable)")
	fs.StringVar(&c.output, "output", "", "write per-request stats as JSON to this file")
	fs.Uint64Var(&c.seed, "seed", 0, "seed for generated conversations and arrivals")
	fs.DurationVar(&c.timeout, "request-timeout", 10*time.Minute, "limit per request")
	if err := fs.Parse(args); err != nil {
		return config{}, flagError(fs, err, help)
	}
	if err := durflag.Check(fs, args, "request-timeout"); err != nil {
		return config{}, err
	}
	switch {
	case c.input == "":
		return config{}, errors.New("--input is required (bench --help lists the modes and flags)")
	case c.clients < 1:
		return config{}, errors.New("--clients must be at least 1")
	case c.maxActive < 0 || c.rate < 0 || c.maxTurns < 0 || c.limit < 0 || c.maxTokens < 1:
		return config{}, errors.New("negative --max-active, --request-rate, --max-turns or --limit, or --max-tokens < 1")
	}
	if c.maxActive == 0 {
		c.maxActive = c.clients
	}
	c.url = strings.TrimRight(c.url, "/")
	return c, nil
}
