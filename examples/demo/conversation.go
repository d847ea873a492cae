package main

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand/v2"
	"strings"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// conversation is an agent session: a task, then tool results and the
// agent's replies, resent whole every turn as a chat client does.
type conversation struct {
	id       int
	rng      *rand.Rand
	messages []message
	targets  []int // prompt tokens wanted at each turn
	reply    int   // max_tokens
	suffix   int   // > 0: each turn after the first adds exactly this many tokens
}

const systemPrompt = "You are a coding agent in a large Go repository. Tools: list_files(dir), read_file(path), " +
	"run_tests(pkg), edit_file(path, patch). Read before you edit, keep changes small, run the tests after each edit " +
	"and explain every step in one sentence."

// words is the vocabulary of generated tool output.
var words = strings.Fields(`func return err nil if for range struct type package import var const go defer
select case chan map string int byte error context time http json test assert require handle block prefill decode
router engine stream event token cache layer buffer offset index value key store retain expire lease pull push`)

func newConversation(id int, c config) *conversation {
	cv := &conversation{
		id:    id,
		rng:   rand.New(rand.NewPCG(c.seed, uint64(id))),
		reply: c.replyTokens,
	}
	// The prompt grows by c.growth() a turn: turn 0 below startTokens, turn 1
	// at startTokens, the last at endTokens. Turns 1 and last are the
	// published points, so they and the turns before them are exact; the
	// others are jittered by up to 15% of a step.
	cv.suffix = c.suffixTokens
	g := math.Log(c.growth())
	for t := range c.turns {
		if c.suffixTokens > 0 {
			cv.targets = append(cv.targets, c.nominal(t))
			continue
		}
		jitter := 0.0
		if t > 1 && t < c.turns-2 {
			jitter = (cv.rng.Float64()*2 - 1) * 0.15
		}
		target := c.nominal(t)
		if jitter != 0 {
			target = int(math.Round(float64(target) * math.Exp(jitter*g)))
		}
		cv.targets = append(cv.targets, target)
	}
	cv.messages = []message{{Role: "system", Content: systemPrompt}}
	return cv
}

// next appends the turn's new input (the task, then a tool result) sized so
// that the prompt has about targets[turn] tokens, and returns the body.
func (cv *conversation) next(turn int) ([]byte, error) {
	role, head := "user", fmt.Sprintf("Task %d: the tests in package m%d fail. Find the cause and fix it. Repository map:\n", cv.id, cv.id)
	if turn > 0 {
		head = fmt.Sprintf("Tool result (read_file m%d/file%d.go):\n", cv.id, turn)
	}
	if cv.suffix > 0 && turn > 0 {
		// The history so far, as the next prompt renders it, plus the
		// suffix: count the prompt with an empty tool result first.
		cv.messages = append(cv.messages, message{Role: role, Content: ""})
		body, err := cv.body()
		if err != nil {
			return nil, err
		}
		n, err := kvroutetest.CountTokens(kvroute.PathChatCompletions, body)
		if err != nil {
			return nil, err
		}
		cv.messages = cv.messages[:len(cv.messages)-1]
		cv.targets[turn] = n + cv.suffix
	}
	cv.messages = append(cv.messages, message{Role: role, Content: head})
	last := &cv.messages[len(cv.messages)-1]
	var text strings.Builder
	for range 3 { // the count is linear in the words added: converges at once
		body, err := cv.body()
		if err != nil {
			return nil, err
		}
		n, err := kvroutetest.CountTokens(kvroute.PathChatCompletions, body)
		if err != nil {
			return nil, err
		}
		missing := cv.targets[turn] - n
		if missing <= 0 {
			return body, nil
		}
		for added := 0; added < missing; added++ {
			// " word" is one token; "\n" and "word" are two.
			if text.Len() > 0 && missing-added > 1 && cv.rng.IntN(12) == 0 {
				text.WriteString("\n")
				added++
			} else {
				text.WriteString(" ")
			}
			text.WriteString(words[cv.rng.IntN(len(words))])
		}
		last.Content = head + text.String()
	}
	return cv.body()
}

// hear appends the reply the client received, as vLLM's multi-turn
// benchmark does.
func (cv *conversation) hear(reply string) {
	cv.messages = append(cv.messages, message{Role: "assistant", Content: reply})
}

func (cv *conversation) body() ([]byte, error) {
	return json.Marshal(map[string]any{
		"model":          kvroutetest.DefaultModel,
		"messages":       cv.messages,
		"max_tokens":     cv.reply,
		"stream":         true,
		"stream_options": map[string]any{"include_usage": false},
	})
}
