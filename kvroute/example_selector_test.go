package kvroute_test

import (
	"context"
	"fmt"
	"log"

	"github.com/bidikv/bidikv/kvroute"
)

// fewestHeld places a new conversation's decode leg on the decode engine
// where the Router's retained handles pin the fewest tokens
// (Candidate.HeldTokens), so that holds spread over the engines; a later
// turn stays with the engine that holds its KV (Selection.Affinity), and
// prefill legs go as LeastLoaded sends them. A Selector is called
// concurrently: this one keeps no state of its own.
type fewestHeld struct{ kvroute.LeastLoaded }

func (f *fewestHeld) Select(ctx context.Context, s *kvroute.Selection) (int, error) {
	if s.Phase != kvroute.PhaseDecode || s.Affinity != "" {
		return f.LeastLoaded.Select(ctx, s)
	}
	best := 0
	for i, c := range s.Candidates {
		if c.HeldTokens < s.Candidates[best].HeldTokens {
			best = i
		}
	}
	return best, nil
}

// A custom Selector (WithSelector) sees each decode engine's held tokens.
// Three conversations open on two decode engines: each goes where fewer
// tokens are held, and a conversation's next turn stays where its KV is.
// (A system prompt they share is counted once on an engine, as the engine
// stores it, by granules of budget.PrefixGranule tokens: this one,
// shorter, is counted per conversation.)
func ExampleSelector() {
	p, d, stop := startEngines(2)
	defer stop()
	decode := []string{d[0].URL(), d[1].URL()}
	var last kvroute.TurnRecord
	router, err := kvroute.New(kvroute.WithPrefill(p.URL()), kvroute.WithDecode(decode...),
		kvroute.WithSelector(&fewestHeld{}), // the registration line
		kvroute.WithObserver(kvroute.ObserverFunc(func(rec *kvroute.TurnRecord) { last = *rec })))
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	engine := map[string]string{decode[0]: "D1", decode[1]: "D2"}
	held := func() string {
		kv := router.DecodeKV()
		return fmt.Sprintf("D1 holds %d tokens, D2 %d", kv[0].HeldTokens, kv[1].HeldTokens)
	}
	task := []string{
		"The test TestParse fails with an index out of range.",
		"Rename the package util to textutil everywhere, then run go vet and the whole test suite and report what changed.",
		"Why is the build slow?",
	}
	var first []map[string]string
	for i, text := range task {
		messages := []map[string]string{{"role": "system", "content": agentPrompt}, {"role": "user", "content": text}}
		reply, _, _ := ask(router, messages, 8)
		fmt.Printf("conversation %d: %s; %s\n", i+1, engine[last.DecodeEndpoint], held())
		if i == 0 {
			first = append(messages, map[string]string{"role": "assistant", "content": reply},
				map[string]string{"role": "user", "content": "Fix it."})
		}
	}
	_, reuse, _ := ask(router, first, 8)
	fmt.Printf("conversation 1, turn 2: %s on %s\n", reuse, engine[last.DecodeEndpoint])
	// Output:
	// conversation 1: D1; D1 holds 80 tokens, D2 0
	// conversation 2: D2; D1 holds 80 tokens, D2 96
	// conversation 3: D1; D1 holds 160 tokens, D2 96
	// conversation 1, turn 2: hit on D1
}
