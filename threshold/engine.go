package threshold

import (
	"errors"
	"fmt"
)

// DefaultThreshold is the engine's default kv_recompute_threshold, in tokens.
const DefaultThreshold = 64

// ErrNegativeThreshold is returned by [Engine] for a threshold below 0.
var ErrNegativeThreshold = errors.New("threshold: threshold must not be negative")

// engine is the prefill engine's rule with a fixed threshold.
type engine struct {
	threshold int
}

// Engine returns the prefill engine's rule with the given
// kv_recompute_threshold: reuse when [Input.Count] is positive and not below
// threshold. A threshold of 0 disables the size check, so any positive count
// reuses. A negative threshold returns an error wrapping
// [ErrNegativeThreshold]; set it to match the engines' kv_recompute_threshold
// (0 to disable the check).
func Engine(threshold int) (Policy, error) {
	if threshold < 0 {
		return nil, fmt.Errorf("%w: got %d; use 0 to disable the check or %d for the engine default",
			ErrNegativeThreshold, threshold, DefaultThreshold)
	}
	return engine{threshold: threshold}, nil
}

// Default returns the engine's rule with [DefaultThreshold].
func Default() Policy { return engine{threshold: DefaultThreshold} }

// Reuse implements [Policy].
func (e engine) Reuse(in Input) bool {
	n := in.Count()
	return n > 0 && n >= e.threshold
}
