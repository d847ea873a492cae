package toytok_test

import (
	"fmt"
	"slices"

	"github.com/bidikv/bidikv/internal/toytok"
)

// An honest next turn renders to ids that begin with the previous prompt
// and the reply's ids: what token verification needs.
func Example() {
	turn1 := []toytok.Message{{Role: "user", Content: "list the files"}}
	prompt := toytok.Chat(turn1)
	reply := toytok.Reply("main.go")
	turn2 := append(slices.Clone(turn1), toytok.Message{Role: "assistant", Content: "main.go"}, toytok.Message{Role: "user", Content: "open it"})
	next := toytok.Chat(turn2)
	held := append(slices.Clone(prompt), reply...)
	fmt.Println(len(prompt), len(reply), len(next))
	fmt.Println(slices.Equal(next[:len(held)], held))
	// Output:
	// 6 3 14
	// true
}
