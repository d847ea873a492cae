package sim

// Chain exposes the KV chain to the tests: the kv value of each of toks
// computed from the model seed at positions 0, 1, ...
func Chain(model string, toks []uint32) []uint64 { return chain(Seed(model), toks, 0) }
