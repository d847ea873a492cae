package main

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The fleet's agent sessions, drawn from the seed before any arm runs, so
// that both arms see the same arrivals, inputs and pauses (the replies are
// the engines' and, answers being right, the same too).
//
// The pauses between turns follow the Mooncake trace (BENCHMARKS.md
// section 8: the gap before a request's next turn is p50 123 s, p90
// 480 s, p99 1,470 s): a person's turn waits a log-normal pause of median
// 123 s and sigma 1.06, whose p90 is 480 s and p99 1,457 s; a tool call's
// result comes back after a log-normal pause of median 6 s. Half the
// turns are tool calls (toolShare: --tool-share). A session ends after its first turn with
// probability 0.4 and after a later one with probability 0.1 (a
// conversation on its second turn comes back twice as often as a first
// request, as in the trace), or when its prompt would pass maxPrompt.
const (
	gapHumanMedian = 123 * time.Second
	gapHumanSigma  = 1.06
	gapToolMedian  = 6 * time.Second
	gapToolSigma   = 0.7
	// toolShare is the default share of the replies that call a tool.
	toolShare = 0.5
	// continueFirst and continueLater: the chance a session has a next
	// turn after its first turn and after a later one.
	continueFirst = 0.6
	continueLater = 0.9
	// a tool result's tokens: log-normal, median 2,000, sigma 0.9, clipped
	toolMedian, toolSigma = 2000, 0.9
	toolMin, toolMax      = 100, 16000
	replyMin, replyMax    = 64, 384 // max_tokens (ignore_eos: the reply's length)
)

// sessionPlan is one agent session: when it starts and its turns.
type sessionPlan struct {
	id      int
	arrival time.Duration // from the run's start
	system  int           // tokens of the system prompt (tools, instructions)
	turns   []turnPlan
}

// turnPlan is one turn: the input sent (a task, a person's message or a
// tool result), the reply's length and the pause after the answer.
type turnPlan struct {
	input int // tokens of new input
	// tool: this turn's reply calls a tool, so the pause after it is
	// short and the next turn's input is the tool's result
	tool      bool
	maxTokens int
	pause     time.Duration // after this turn's answer; 0 after the last
}

// planFleet draws n sessions arriving uniformly over window.
func planFleet(seed uint64, n int, window time.Duration, maxTurns, maxPrompt int, share float64) []sessionPlan {
	out := make([]sessionPlan, n)
	for i := range out {
		rng := rand.New(rand.NewPCG(seed, uint64(i)))
		s := sessionPlan{id: i, arrival: time.Duration(rng.Int64N(int64(window) + 1)), system: 2000 + rng.IntN(6000)}
		prompt := s.system
		for t := 0; t < maxTurns; t++ {
			tp := turnPlan{maxTokens: replyMin + rng.IntN(replyMax-replyMin+1), input: 30 + rng.IntN(370)}
			if t > 0 && s.turns[t-1].tool {
				tp.tool = true
				tp.input = int(clip(logNormal(rng, toolMedian, toolSigma), toolMin, toolMax))
			}
			if prompt+tp.input+tp.maxTokens > maxPrompt {
				break
			}
			prompt += tp.input + tp.maxTokens
			s.turns = append(s.turns, tp)
			cont := continueLater
			if t == 0 {
				cont = continueFirst
			}
			if rng.Float64() >= cont {
				break
			}
			// the pause after this turn: its reply calls a tool, or a
			// person reads it
			last := &s.turns[len(s.turns)-1]
			last.tool = rng.Float64() < share
			if last.tool {
				last.pause = time.Duration(clip(logNormal(rng, float64(gapToolMedian), gapToolSigma), float64(time.Second), float64(time.Minute)-1))
			} else {
				last.pause = time.Duration(clip(logNormal(rng, float64(gapHumanMedian), gapHumanSigma), float64(5*time.Second), float64(time.Hour)))
			}
		}
		// the last turn has no pause after it
		s.turns[len(s.turns)-1].pause = 0
		out[i] = s
	}
	return out
}

func logNormal(rng *rand.Rand, median, sigma float64) float64 {
	return median * math.Exp(sigma*rng.NormFloat64())
}

func clip(v, lo, hi float64) float64 { return min(max(v, lo), hi) }

// chatMessage is one message of a session's history: a tool call's
// assistant message carries the call, the tool's result its id.
type chatMessage struct {
	Role       string     `json:"role"`
	Content    string     `json:"content"`
	ToolCalls  []toolCall `json:"tool_calls,omitempty"`
	ToolCallID string     `json:"tool_call_id,omitempty"`
}

// toolCall is a reply's tool call, sent back as the engine wrote it.
type toolCall struct {
	ID       string `json:"id"`
	Type     string `json:"type"`
	Function struct {
		Name      string `json:"name"`
		Arguments string `json:"arguments"`
	} `json:"function"`
}

// fleetTool is the one tool the sessions' agents have. A turn whose
// reply calls it names it in tool_choice, so that the (simulated) model
// calls it: the router sees a reply that ends in a tool call, as it does
// an agent's.
const fleetTool = "run"

var fleetTools = []any{map[string]any{"type": "function", "function": map[string]any{"name": fleetTool,
	"description": "Run a command in the workspace and return its output.",
	"parameters":  map[string]any{"type": "object", "properties": map[string]any{"command": map[string]any{"type": "string"}}}}}}

// session is a plan being run: its history and the generator of its
// inputs' text, seeded by the plan alone (the same text in every arm).
type session struct {
	plan     sessionPlan
	rng      *rand.Rand
	messages []chatMessage
}

func newSession(seed uint64, p sessionPlan) *session {
	s := &session{plan: p, rng: rand.New(rand.NewPCG(seed^0x5eed, uint64(p.id)))}
	s.messages = []chatMessage{{Role: "system", Content: fmt.Sprintf("You are agent %d. Tools:", p.id) + s.words(p.system)}}
	return s
}

// words returns n tokens of text: " word" is one token.
func (s *session) words(n int) string {
	var b strings.Builder
	b.Grow(n * 8)
	for range n {
		b.WriteByte(' ')
		b.WriteString(fleetWords[s.rng.IntN(len(fleetWords))])
	}
	return b.String()
}

// body appends turn t's input and returns the request body.
func (s *session) body(t int) ([]byte, error) {
	tp := s.plan.turns[t]
	switch {
	case t == 0:
		s.messages = append(s.messages, chatMessage{Role: "user", Content: fmt.Sprintf("Task %d:", s.plan.id) + s.words(tp.input)})
	case s.plan.turns[t-1].tool:
		last := s.messages[len(s.messages)-1]
		id := ""
		if len(last.ToolCalls) > 0 {
			id = last.ToolCalls[0].ID
		}
		s.messages = append(s.messages, chatMessage{Role: "tool", ToolCallID: id, Content: fmt.Sprintf("Tool result %d:", t) + s.words(tp.input)})
	default:
		s.messages = append(s.messages, chatMessage{Role: "user", Content: "Next:" + s.words(tp.input)})
	}
	body := map[string]any{
		"model":      kvroutetest.DefaultModel,
		"messages":   s.messages,
		"tools":      fleetTools,
		"max_tokens": tp.maxTokens,
		"ignore_eos": true,
	}
	if tp.tool {
		body["tool_choice"] = map[string]any{"type": "function", "function": map[string]any{"name": fleetTool}}
	}
	return json.Marshal(body)
}

// hear appends the reply message (its text, or its tool calls), as a
// client sends it back.
func (s *session) hear(reply chatMessage) {
	s.messages = append(s.messages, reply)
}

var fleetWords = strings.Fields(`the a function returns error value test file package build module
config handler request response stream token cache block engine decode prefill router session turn
memory budget release hold capacity metric latency queue preempt compute transfer handle store key
index slice map struct interface method pointer channel context deadline retry backoff timeout
parse render verify commit branch merge diff patch line column offset length count size limit`)
