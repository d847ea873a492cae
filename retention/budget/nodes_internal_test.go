package budget

import (
	"math/rand/v2"
	"testing"
)

// The node table agrees with a map under random adds, updates and
// removes, through growing and shrinking, with ids that crowd a few
// slots (consecutive ones) and ids spread over all of them.
func TestNodesTable(t *testing.T) {
	for _, spread := range []bool{false, true} {
		rng := rand.New(rand.NewPCG(5, 9))
		var tab nodes
		ref := map[uint64]uint32{}
		pool := make([]uint64, 3000)
		for i := range pool {
			pool[i] = uint64(i)
			if spread {
				pool[i] = rng.Uint64()
			}
		}
		id := func() uint64 { return pool[rng.IntN(len(pool))] }
		for step := range 200_000 {
			k := id()
			want, ok := ref[k]
			nd := tab.find(k)
			if ok != (nd != nil) || ok && nd.span != want {
				t.Fatalf("step %d: find(%d) = %v, want %v %v", step, k, nd, want, ok)
			}
			// Grow to about 2,000 nodes, shrink to none, and again.
			adding := step%100_000 < 50_000
			switch {
			case nd == nil && adding:
				nd = tab.add(k)
				nd.refs, nd.span = 1, uint32(step)
				ref[k] = uint32(step)
			case nd != nil && !adding:
				tab.remove(nd)
				delete(ref, k)
			case nd != nil:
				nd.span = uint32(step)
				ref[k] = uint32(step)
			}
			if tab.n != len(ref) {
				t.Fatalf("step %d: %d nodes, want %d", step, tab.n, len(ref))
			}
			if len(tab.slots) > minSlots && 8*tab.n < len(tab.slots)/2 || 2*tab.n > len(tab.slots) {
				t.Fatalf("step %d: %d slots for %d nodes", step, len(tab.slots), tab.n)
			}
			if step%50_000 == 49_999 {
				t.Logf("step %d: %d nodes in %d slots", step, tab.n, len(tab.slots))
			}
		}
		for k, v := range ref {
			if nd := tab.find(k); nd == nil || nd.span != v {
				t.Fatalf("find(%d) = %v, want %d", k, nd, v)
			}
		}
	}
}
