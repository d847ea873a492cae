package kvroutetest

import (
	"errors"
	"fmt"

	"github.com/bidikv/bidikv/internal/sim"
)

// Answer is what a single, non-disaggregated engine answers.
type Answer struct {
	// Text is the content (chat) or text (completions) of the first choice.
	Text string
	// Reasoning is the reasoning field (chat with WithReasoning and a
	// reasoning parser; "" when the model did not think).
	Reasoning                      string
	FinishReason                   string
	PromptTokens, CompletionTokens int
	// PromptTokenIDs and TokenIDs are what return_token_ids returns:
	// the rendered prompt's ids and every generated id of the first
	// choice (a final EOS and tokens cut by a stop string included).
	PromptTokenIDs, TokenIDs []uint32
}

// Reference returns the answer of a single engine that holds the correct KV
// for the request: what disaggregated serving must reproduce. path is
// "/v1/chat/completions" or "/v1/completions"; the model comes from the
// body (default "sim-model"). Of the options only WithModel (the default
// model), WithReasoning, WithReasoningParser, WithTemplate, WithContentFormat
// and WithDriftRate matter; the answer does not depend on block size,
// caching or cost.
func Reference(path string, body []byte, opts ...Option) (Answer, error) {
	c := defaultConfig()
	for _, o := range opts {
		o.apply(&c)
	}
	req, err := c.sim.ParseRequest(path, body)
	if err != nil {
		return Answer{}, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	model := req.Model
	if model == "" {
		model = c.sim.Model
	}
	toks := make([]uint32, len(req.Prompt))
	for i, t := range req.Prompt {
		toks[i] = t.ID
	}
	g := sim.Reference(model, toks, c.sim.GenParams(req, 0))
	content, reasoning := c.sim.ChatContent(g)
	a := Answer{Text: content, FinishReason: g.Finish, PromptTokens: len(toks), CompletionTokens: len(g.Tokens),
		PromptTokenIDs: toks, TokenIDs: make([]uint32, len(g.Tokens))}
	for i, t := range g.Tokens {
		a.TokenIDs[i] = t.ID
	}
	if reasoning != nil {
		a.Reasoning = *reasoning
	}
	if path == sim.PathCompletions {
		a.Text = sim.RawText(g)
	}
	return a, nil
}

// ErrBadRequest is wrapped by CountTokens and Reference errors for bodies an
// engine would answer with 400.
var ErrBadRequest = errors.New("kvroutetest: bad request")

// CountTokens returns the number of prompt tokens of the rendered request
// (the prompt_tokens an engine reports).
func CountTokens(path string, body []byte) (int, error) {
	req, err := sim.ParseRequest(path, body)
	if err != nil {
		return 0, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	return len(req.Prompt), nil
}
