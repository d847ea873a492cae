package budget_test

import (
	"fmt"
	"log"
	"time"

	"github.com/bidikv/bidikv/retention/budget"
)

func Example() {
	// A decode engine with room for 100,000 tokens of KV: holds may take
	// half of it.
	b, err := budget.New(budget.WithFraction(0.5))
	if err != nil {
		log.Fatal(err)
	}
	b.SetCapacity("http://d0:8000", budget.Capacity{Tokens: 100_000, BlockSize: 16})

	now := time.Date(2026, 1, 1, 12, 0, 0, 0, time.UTC)
	hold := func(key string, tokens int, age time.Duration, f budget.Features) {
		created := now.Add(-age)
		err := b.Add(budget.Hold{
			Key: key, Engine: "http://d0:8000", Tokens: tokens,
			Created: created, Expires: created.Add(480 * time.Second),
			Features: f,
			// From the router's cost model: what a hit saves.
			Saved: time.Duration(tokens) * 10 * time.Microsecond,
		})
		if err != nil {
			log.Fatal(err)
		}
	}
	hold("agent-7", 20_000, 400*time.Second, budget.Features{Class: "acme/qwen3", Turn: 3})
	hold("chat-1", 20_000, 200*time.Second, budget.Features{Class: "acme/qwen3", Turn: 1})
	hold("agent-9", 8_000, 5*time.Second, budget.Features{Class: "acme/qwen3", Turn: 6, ToolCalls: true})

	// 48,000 tokens held: under the budget of 50,000, nothing is released.
	fmt.Println(len(b.Victims("http://d0:8000", 0, now)))

	// A new 12,000-token hold would go over: release the least valuable.
	for _, v := range b.Victims("http://d0:8000", 12_000, now) {
		fmt.Printf("release %s (%d tokens)\n", v.Key, v.Tokens)
	}
	u := b.Usage(now)[0]
	fmt.Printf("held %d of a budget of %d tokens\n", u.HeldTokens, u.Budget)

	// The next turn of agent-9 comes: its hold leaves the ledger, to be
	// attached, and the gap is learned.
	fmt.Println(b.Return("agent-9", now.Add(3*time.Second)))
	// Output:
	// 0
	// release agent-7 (20000 tokens)
	// held 28000 of a budget of 50000 tokens
	// true
}
