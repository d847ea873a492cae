package kvroutetest

import (
	"encoding/json"
	"errors"
	"fmt"

	"github.com/bidikv/bidikv/internal/sim"
)

// Paths an Engine serves requests on (Reference takes the first five).
const (
	PathChat        = sim.PathChat        // POST /v1/chat/completions
	PathCompletions = sim.PathCompletions // POST /v1/completions
	// PathResponses is OpenAI's Responses API (vLLM's
	// /v1/responses, with kv_transfer_params since vLLM PR #37424).
	PathResponses = sim.PathResponses
	// PathMessages is Anthropic's Messages API (vLLM's /v1/messages, with
	// kv_transfer_params since vLLM PR #37535); a query string such as
	// ?beta=true is accepted.
	PathMessages = sim.PathMessages
	// PathMessagesCountTokens is POST /v1/messages/count_tokens:
	// {"input_tokens": n, ...}.
	PathMessagesCountTokens = sim.PathCountTokens
	// The render endpoints: vLLM's GenerateRequest for the body (a list of
	// one for completions); see WithRenderer and WithRenderRoutes.
	PathChatRender        = sim.PathChatRender
	PathCompletionsRender = sim.PathCompletionsRender
	PathResponsesRender   = sim.PathResponsesRender
	PathMessagesRender    = sim.PathMessagesRender
	// PathTokenize is vLLM's older POST /tokenize.
	PathTokenize = sim.PathTokenize
)

// Answer is what a single, non-disaggregated engine answers.
type Answer struct {
	// Text is the content (chat) or text (completions) of the first
	// choice; for the Responses API the output_text of the message item,
	// for the Messages API the text block (each "" when there is no text).
	Text string
	// Reasoning is the reasoning field (chat with WithReasoning and a
	// reasoning parser; "" when the model did not think); for the
	// Responses API the reasoning item's text, for the Messages API the
	// thinking block's.
	Reasoning string
	// ToolCalls are the reply's tool calls (tool_choice auto, required or
	// named; see WithToolCallRate), nil when none: the Responses API's
	// function_call items, the Messages API's tool_use blocks (whose input
	// is Arguments parsed).
	ToolCalls []ToolCall
	// FinishReason is chat's finish_reason for every path, as the request
	// (streamed or not) gets it: "stop", "length" or "tool_calls" (the
	// Responses API reports "length" as status "incomplete" and the others
	// as "completed", the Messages API "length" as stop_reason
	// "max_tokens", "tool_calls" as "tool_use" and "stop" as "end_turn").
	FinishReason                   string
	PromptTokens, CompletionTokens int
	// PromptTokenIDs and TokenIDs are what return_token_ids returns:
	// the rendered prompt's ids and every generated id of the first
	// choice (a final EOS and tokens cut by a stop string included).
	PromptTokenIDs, TokenIDs []uint32
	// Logprobs is the first choice's logprobs value, byte for byte as a
	// non-streaming chat or completions answer carries it (chat:
	// {"content": [...]}, completions: {"text_offset", "token_logprobs",
	// "tokens", "top_logprobs"}), "null" when the request did not ask for
	// logprobs; nil for the Responses and Messages APIs. A stream carries
	// the same entries split over its chunks (chat's less those of tokens
	// a parser swallows without a chunk).
	Logprobs json.RawMessage
}

// Reference returns the answer of a single engine that holds the correct KV
// for the request: what disaggregated serving must reproduce. path is
// PathChat, PathCompletions, PathResponses, PathMessages or
// PathMessagesCountTokens (whose answer is only PromptTokens and
// PromptTokenIDs worth); the model comes from the body (default
// "sim-model"). Responses and Messages bodies are rendered as vLLM renders
// them, as chat: the same conversation gives the same prompt as chat. Of the options only WithModel (the default
// model), WithReasoning, WithReasoningParser, WithTemplate, WithContentFormat,
// WithDriftRate and WithToolCallRate matter; the answer does not depend on block size,
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
	p := c.sim.Parse(g, req, req.Stream)
	a := Answer{Text: p.Content, FinishReason: p.Finish, PromptTokens: len(toks), CompletionTokens: len(g.Tokens),
		PromptTokenIDs: toks, TokenIDs: make([]uint32, len(g.Tokens))}
	for i, t := range g.Tokens {
		a.TokenIDs[i] = t.ID
	}
	for _, call := range p.Calls {
		a.ToolCalls = append(a.ToolCalls, ToolCall(call))
	}
	if p.Reasoning != nil {
		a.Reasoning = *p.Reasoning
	}
	if path == sim.PathCompletions {
		a.Text = sim.RawText(g)
	}
	if path == sim.PathChat || path == sim.PathCompletions {
		a.Logprobs = sim.ChoiceLogprobs(req, g)
	}
	return a, nil
}

// ToolCall is a tool call of a reply: the tool's name and its arguments
// (a JSON object's text, as vLLM's parsers return it).
type ToolCall struct{ Name, Arguments string }

// ErrBadRequest is wrapped by CountTokens and Reference errors for bodies an
// engine would answer with 400.
var ErrBadRequest = errors.New("kvroutetest: bad request")

// CountTokens returns the number of prompt tokens of the rendered request
// (the prompt_tokens an engine reports, input_tokens for the Responses and
// Messages APIs) for any path Reference takes, with the default
// configuration's template.
func CountTokens(path string, body []byte) (int, error) {
	req, err := sim.ParseRequest(path, body)
	if err != nil {
		return 0, fmt.Errorf("%w: %v", ErrBadRequest, err)
	}
	return len(req.Prompt), nil
}
