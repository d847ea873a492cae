package threshold_test

import (
	"fmt"

	"github.com/bidikv/bidikv/threshold"
)

func Example() {
	p := threshold.Default()

	// The decode engine holds 1200 tokens of the conversation; the router
	// does not know the new prompt's length or the prefill cache.
	fmt.Println(p.Reuse(threshold.Input{RemoteTokens: 1200}))

	// The prefill engine already caches all but 40 of those tokens: fewer
	// than 64 to pull, so it would recompute them.
	fmt.Println(p.Reuse(threshold.Input{RemoteTokens: 1200, CachedTokens: 1160}))
	// Output:
	// true
	// false
}

func ExampleEngine() {
	p, err := threshold.Engine(0) // match engines run with kv_recompute_threshold 0
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(p.Reuse(threshold.Input{RemoteTokens: 1}))

	_, err = threshold.Engine(-1)
	fmt.Println(err)
	// Output:
	// true
	// threshold: threshold must not be negative: got -1; use 0 to disable the check or 64 for the engine default
}

func ExampleCostModel() {
	m, err := threshold.NewCostModel(threshold.CostConfig{Static: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	// 24,000 tokens of history on the decode engine and a 300-token tool
	// result: the decode engine computes the suffix itself.
	c := m.Choose(threshold.Turn{PromptTokens: 24300, ReusableTokens: 24000, Decode: "http://d1"})
	fmt.Println(c.Path, c.Local < c.Pull)
	c.Release()

	// A 4,000-token suffix exceeds the default bound of decode-local work.
	c = m.Choose(threshold.Turn{PromptTokens: 28097, ReusableTokens: 24000, Decode: "http://d1"})
	fmt.Println(c.Path, c.Refusal)
	// Output:
	// decode_local true
	// pull suffix
}
