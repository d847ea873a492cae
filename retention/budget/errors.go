package budget

import "errors"

var (
	// ErrInvalidConfig is wrapped by [New] and [NewModel] when an option is
	// out of range; the message names the option and its default.
	ErrInvalidConfig = errors.New("budget: invalid configuration")
	// ErrInvalidHold is wrapped by [Budget.Add] when a hold lacks its key or
	// engine, has no tokens, or expires before it is created.
	ErrInvalidHold = errors.New("budget: invalid hold")
)
