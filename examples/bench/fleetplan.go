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
// that every arm sees the same arrivals, inputs and pauses (the replies are
// the engines' and, answers being right, the same too).
//
// Every request carries the agent's one tool with tool_choice auto, as
// agents send it; the model decides which replies call it (the simulated
// engines' tool call rate, --tool-share: the share of replies that call a
// tool, decided from each reply's KV, so every arm and the reference see
// the same calls; a call finishes as "tool_calls", as vLLM answers auto).
// The plan therefore draws both continuations of every turn, and the reply
// picks one: after a tool call, the tool's result comes back after a
// log-normal pause of median 6 s; after text, a person reads it and
// answers after a log-normal pause of median 123 s and sigma 1.06, whose
// p90 is 480 s and p99 1,457 s (the Mooncake trace's gaps, BENCHMARKS.md
// section 8: p50 123 s, p90 480 s, p99 1,470 s).
//
// Every tool call is answered: an agent sends the tool's result back, so a
// session ends only after a reply that did not call the tool, with
// probability endFirst after its first turn and endLater after a later one
// (with half the replies calling the tool, 0.4 and 0.1 a turn). A session
// also ends at maxTurns or before its prompt could pass maxPrompt
// (counting each turn's larger input); that last turn is sent with
// tool_choice "none", as an agent out of steps asks for its final answer,
// so that no call is left unanswered.
//
// A share of the sessions (--shared-system, default 0.5) starts with one
// common system prompt of sharedSystemTokens (4,096 tokens: one agent
// product's instructions and tool descriptions, which every session of it
// sends verbatim); the others have their own of 2k-8k tokens.
const (
	gapHumanMedian = 123 * time.Second
	gapHumanSigma  = 1.06
	gapToolMedian  = 6 * time.Second
	gapToolSigma   = 0.7
	// toolShare is the default share of the replies that call a tool.
	toolShare = 0.5
	// endFirst and endLater: the chance a session ends after a text
	// reply of its first turn and of a later one.
	endFirst = 0.8
	endLater = 0.2
	// sharedShare is the default share of the sessions with the common
	// system prompt, of sharedSystemTokens.
	sharedShare        = 0.5
	sharedSystemTokens = 4096
	// a tool result's tokens: log-normal, median 2,000, sigma 0.9, clipped
	toolMedian, toolSigma = 2000, 0.9
	toolMin, toolMax      = 100, 16000
	// a reply's text is replyMin to replyMax tokens (min_tokens: the
	// model may end or call its tool only then); a call adds at most
	// callRoom (max_tokens is min_tokens + callRoom, so no call is cut)
	replyMin, replyMax = 64, 384
	callRoom           = 64
)

// sessionPlan is one agent session: when it starts and its turns.
type sessionPlan struct {
	id      int
	arrival time.Duration // from the run's start
	system  int           // tokens of the system prompt (tools, instructions)
	shared  bool          // the system prompt is the common one
	turns   []turnPlan
}

// turnPlan is one turn: its input (a task or a person's message, or the
// tool's result when the reply before called the tool), the reply's
// length and the pause after the answer (a tool's or a person's, as the
// reply calls the tool or not).
type turnPlan struct {
	input     int // tokens of the task (turn 0) or of a person's message
	toolInput int // tokens of the tool's result, after a reply that called it
	minTokens int // the reply's text: min_tokens
	// the pause after this turn's answer when its reply calls the tool
	// (the tool runs) or not (a person reads it); 0 after the last turn
	toolPause, humanPause time.Duration
	// endText: the session ends after this turn when its reply does not
	// call the tool
	endText bool
}

// pause is the pause after the turn, whose reply called the tool or not.
func (tp turnPlan) pause(called bool) time.Duration {
	if called {
		return tp.toolPause
	}
	return tp.humanPause
}

// planFleet draws n sessions arriving uniformly over window, share of them
// with the common system prompt.
func planFleet(seed uint64, n int, window time.Duration, maxTurns, maxPrompt int, share float64) []sessionPlan {
	out := make([]sessionPlan, n)
	for i := range out {
		rng := rand.New(rand.NewPCG(seed, uint64(i)))
		s := sessionPlan{id: i, arrival: time.Duration(rng.Int64N(int64(window) + 1)), system: 2000 + rng.IntN(6000)}
		if rng.Float64() < share {
			s.shared, s.system = true, sharedSystemTokens
		}
		prompt := s.system
		for t := 0; t < maxTurns; t++ {
			tp := turnPlan{minTokens: replyMin + rng.IntN(replyMax-replyMin+1), input: 30 + rng.IntN(370),
				toolInput: int(clip(logNormal(rng, toolMedian, toolSigma), toolMin, toolMax))}
			in := tp.input
			if t > 0 {
				in = max(in, tp.toolInput)
			}
			if prompt+in+tp.minTokens+callRoom > maxPrompt {
				break
			}
			prompt += in + tp.minTokens + callRoom
			end := endLater
			if t == 0 {
				end = endFirst
			}
			tp.endText = rng.Float64() < end
			// the pause after this turn: the tool's result, or a person
			tp.toolPause = time.Duration(clip(logNormal(rng, float64(gapToolMedian), gapToolSigma), float64(time.Second), float64(time.Minute)-1))
			tp.humanPause = time.Duration(clip(logNormal(rng, float64(gapHumanMedian), gapHumanSigma), float64(5*time.Second), float64(time.Hour)))
			s.turns = append(s.turns, tp)
		}
		// the last turn has no pause after it
		s.turns[len(s.turns)-1].toolPause, s.turns[len(s.turns)-1].humanPause = 0, 0
		out[i] = s
	}
	return out
}

// ends reports whether the session ends after turn t, whose reply called
// the tool or not: a call is always answered, except after the plan's last
// turn (sent with tool_choice none, so it calls nothing).
func (sp sessionPlan) ends(t int, called bool) bool {
	return t == len(sp.turns)-1 || (!called && sp.turns[t].endText)
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

// fleetTool is the one tool the sessions' agents have; every request
// offers it with tool_choice auto.
const fleetTool = "run"

var fleetTools = []any{map[string]any{"type": "function", "function": map[string]any{"name": fleetTool,
	"description": "Run a command in the workspace and return its output.",
	"parameters":  map[string]any{"type": "object", "properties": map[string]any{"command": map[string]any{"type": "string"}}}}}}

// session is a plan being run: its history and the generator of its
// inputs' text, seeded by the plan alone (the same text in every arm, as
// the replies are the same).
type session struct {
	plan     sessionPlan
	rng      *rand.Rand
	messages []chatMessage
	called   bool // the last reply called the tool
}

func newSession(seed uint64, p sessionPlan) *session {
	s := &session{plan: p, rng: rand.New(rand.NewPCG(seed^0x5eed, uint64(p.id)))}
	if p.shared {
		s.messages = []chatMessage{{Role: "system", Content: sharedSystem(seed)}}
	} else {
		s.messages = []chatMessage{{Role: "system", Content: fmt.Sprintf("You are agent %d. Tools:", p.id) + s.words(p.system)}}
	}
	return s
}

// sharedSystem is the common system prompt of the seed's fleet.
func sharedSystem(seed uint64) string {
	s := session{rng: rand.New(rand.NewPCG(seed^0x5a4ed, 0))}
	return "You are a coding agent. Tools:" + s.words(sharedSystemTokens)
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

// body appends turn t's input (the task, the tool's result after a reply
// that called it, or a person's next message) and returns the request
// body: the tool offered with tool_choice auto, the reply's text at least
// the plan's length (min_tokens), then the model ends or calls the tool
// (on the plan's last turn the tool is offered with tool_choice none).
func (s *session) body(t int) ([]byte, error) {
	tp := s.plan.turns[t]
	switch {
	case t == 0:
		s.messages = append(s.messages, chatMessage{Role: "user", Content: fmt.Sprintf("Task %d:", s.plan.id) + s.words(tp.input)})
	case s.called:
		last := s.messages[len(s.messages)-1]
		s.messages = append(s.messages, chatMessage{Role: "tool", ToolCallID: last.ToolCalls[0].ID, Content: fmt.Sprintf("Tool result %d:", t) + s.words(tp.toolInput)})
	default:
		s.messages = append(s.messages, chatMessage{Role: "user", Content: "Next:" + s.words(tp.input)})
	}
	body := map[string]any{
		"model":       kvroutetest.DefaultModel,
		"messages":    s.messages,
		"tools":       fleetTools,
		"tool_choice": toolChoice(t, len(s.plan.turns)),
		"min_tokens":  tp.minTokens,
		"max_tokens":  tp.minTokens + callRoom,
	}
	return json.Marshal(body)
}

// toolChoice is turn t's tool_choice: auto, but none on the plan's last
// turn, so that every call is answered.
func toolChoice(t, turns int) string {
	if t == turns-1 {
		return "none"
	}
	return "auto"
}

// hear appends the reply message (its text and tool calls), as a client
// sends it back.
func (s *session) hear(reply chatMessage) {
	s.messages = append(s.messages, reply)
	s.called = len(reply.ToolCalls) > 0
}

var fleetWords = strings.Fields(`the a function returns error value test file package build module
config handler request response stream token cache block engine decode prefill router session turn
memory budget release hold capacity metric latency queue preempt compute transfer handle store key
index slice map struct interface method pointer channel context deadline retry backoff timeout
parse render verify commit branch merge diff patch line column offset length count size limit`)
