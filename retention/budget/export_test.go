package budget

// Nodes returns how many nodes engine's shared-prefix tree has (at most
// one per distinct granule held).
func (b *Budget) Nodes(engine string) int {
	b.mu.Lock()
	defer b.mu.Unlock()
	if i, ok := b.byName[engine]; ok {
		return b.engines[i].nodes.n
	}
	return 0
}
