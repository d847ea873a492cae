package kvroute_test

import (
	"fmt"
	"log"
	"time"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/retention/budget"
)

// largestFirst is a decode-memory release order: over an engine's budget,
// the holds whose release frees the most blocks (those no other hold
// shares) go first (the ledger releases least value first), whatever the
// learned chance that their conversations come back.
func largestFirst(h budget.Held, waited time.Duration, model float64) float64 {
	return -float64(h.Blocks - h.Shared)
}

// A release order of one's own is a value function of the ledger
// (budget.WithValue) given to the Router (WithDecodeMemory's Ledger). The
// decode engine's holds and live work may take half of its 400 tokens (a
// system prompt they share is counted once, as the engine stores it, by
// granules of budget.PrefixGranule tokens: this one, shorter, is counted
// per hold, an overcount): the third conversation's decode leg would take
// them over, so room is made on its arrival, and the largest hold, the
// second conversation's, is released; its next turn is a miss.
func ExampleDecodeMemory() {
	p, d, stop := startEngines(1)
	defer stop()

	ledger, err := budget.New(budget.WithValue(largestFirst))
	if err != nil {
		log.Fatal(err)
	}
	router, err := kvroute.New(kvroute.WithPrefill(p.URL()), kvroute.WithDecode(d[0].URL()),
		kvroute.WithDecodeMemory(kvroute.DecodeMemory{
			Ledger:   ledger, // the registration line; it takes Budget and Capacity
			Budget:   0.5,
			Capacity: 400,
			// The capacity is the one above, not the engine's /metrics.
			MetricsInterval: -1,
		}))
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	task := []string{
		"The test TestParse fails with an index out of range.",
		"Rename the package util to textutil everywhere, then run go vet and the whole test suite and report what changed.",
		"Why is the build slow?",
	}
	var convs [][]map[string]string
	for _, text := range task {
		messages := []map[string]string{{"role": "system", "content": agentPrompt}, {"role": "user", "content": text}}
		reply, _, _ := ask(router, messages, 8)
		convs = append(convs, append(messages, map[string]string{"role": "assistant", "content": reply},
			map[string]string{"role": "user", "content": "Go on."}))
	}
	// The release request goes in the background.
	released := func() int64 { s := router.Stats(); return s.ReleasedRoom + s.ReleasedBudget }
	for start := time.Now(); released() < 1 && time.Since(start) < 5*time.Second; {
		time.Sleep(time.Millisecond)
	}
	kv := router.DecodeKV()[0]
	fmt.Printf("released: %d hold; the engine holds %d tokens of a budget of %d\n", released(), kv.HeldTokens, kv.Budget)
	for i, messages := range convs {
		_, reuse, _ := ask(router, messages, 8)
		fmt.Printf("conversation %d, turn 2: %s\n", i+1, reuse)
	}
	// Output:
	// released: 1 hold; the engine holds 160 tokens of a budget of 200
	// conversation 1, turn 2: hit
	// conversation 2, turn 2: miss
	// conversation 3, turn 2: hit
}
