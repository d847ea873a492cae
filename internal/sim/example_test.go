package sim_test

import (
	"fmt"

	"github.com/bidikv/bidikv/internal/sim"
)

func ExampleTokenize() {
	for _, t := range sim.Tokenize("<|im_start|>user\nHi there!<|im_end|>\n") {
		fmt.Printf("%q ", t.Text)
	}
	fmt.Println()
	// Output:
	// "<|im_start|>" "user" "\n" "Hi" " there" "!" "<|im_end|>" "\n"
}
