package budget

import (
	"math"
	"testing"
)

// binOf agrees with the bins' edges: each age lies in [edge(b), edge(b+1))
// at the fraction it says.
func TestBinOf(t *testing.T) {
	for _, a := range []float64{0, 0.5, 1, 1.1, 1.2599, 1.26, 1.6, 1.99, 2, 3, 100, 480, 1799.9, 8191, 8192, 1e9, -1, math.NaN()} {
		b, f := binOf(a)
		if b < 0 || b >= nBins || f < 0 || f > 1 {
			t.Fatalf("binOf(%v) = %d, %v", a, b, f)
		}
		if a >= 0 && a < 1<<topOctave {
			lo, hi := edge(b), edge(b+1)
			if a < lo || a >= hi {
				t.Errorf("binOf(%v) = bin %d [%v, %v)", a, b, lo, hi)
			}
			if want := (a - lo) / (hi - lo); math.Abs(f-want) > 1e-9 {
				t.Errorf("binOf(%v) fraction %v, want %v", a, f, want)
			}
		}
	}
}
