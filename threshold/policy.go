package threshold

// Input is what the router knows when it decides whether to reuse a handle.
// A value <= 0 in PromptTokens or CachedTokens means unknown.
type Input struct {
	// RemoteTokens is the handle's remote_num_tokens: how many leading
	// positions of the conversation the decode engine holds.
	RemoteTokens int
	// PromptTokens is the length of the next prompt in tokens, or 0 if
	// unknown.
	PromptTokens int
	// CachedTokens is how many leading prompt tokens the prefill engine
	// already holds in its prefix cache, or 0 if unknown.
	CachedTokens int
}

// Count returns the number of tokens the prefill engine would pull for in,
// mirroring the engine: min(RemoteTokens, PromptTokens) - CachedTokens, where
// an unknown PromptTokens leaves RemoteTokens alone and an unknown
// CachedTokens subtracts nothing. A result <= 0 means nothing to pull.
func (in Input) Count() int {
	n := in.RemoteTokens
	if in.PromptTokens > 0 && in.PromptTokens < n {
		n = in.PromptTokens
	}
	if in.CachedTokens > 0 {
		n -= in.CachedTokens
	}
	return n
}

// Policy decides whether a retained decode handle is worth attaching to the
// next prefill request. Implementations are safe for concurrent use.
type Policy interface {
	// Reuse reports whether the handle described by in should be attached.
	Reuse(in Input) bool
}

// Func adapts an ordinary function to a [Policy].
type Func func(in Input) bool

// Reuse calls f(in).
func (f Func) Reuse(in Input) bool { return f(in) }

// Always returns a Policy that attaches every handle and leaves the whole
// decision to the prefill engine.
func Always() Policy { return Func(func(Input) bool { return true }) }

// Never returns a Policy that attaches no handle: every turn recomputes its
// prompt on the prefill engine.
func Never() Policy { return Func(func(Input) bool { return false }) }
