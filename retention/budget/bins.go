package budget

import (
	"math"
	"time"
)

// The gap model's histogram is log-spaced: bin 0 is [0, 1 s), bin i ≥ 1 is
// [2^((i-1)/3), 2^(i/3)) seconds, three bins an octave, up to 2^13 s
// (2 h 16 min), where the last bin ends. Pauses between turns run from
// seconds (tool calls) to tens of minutes; a third of an octave keeps each
// bin within 26% of its lower edge.
const (
	binsPerOctave = 3
	topOctave     = 13
	nBins         = 1 + binsPerOctave*topOctave
)

// MaxHorizon is the longest [WithHorizon] the model's histogram covers
// (2^13 s, 2 h 16 min 32 s).
const MaxHorizon = time.Duration(1<<topOctave) * time.Second

// edge returns the lower edge of bin i in seconds (edge(nBins) is the top).
func edge(i int) float64 {
	if i == 0 {
		return 0
	}
	return math.Exp2(float64(i-1) / binsPerOctave)
}

// binOf places an age of a seconds: its bin and how far into the bin it
// is, from 0 to 1, linear in the age (curves are interpolated linearly
// within a bin). Ages at or past the top are the end of the last bin. It
// reads the octave from the float's exponent and the third of an octave
// from its mantissa: no logarithm, as Victims calls it for every hold.
func binOf(a float64) (int, float64) {
	if !(a >= 1) { // NaN too
		return 0, max(a, 0)
	}
	if a >= 1<<topOctave {
		return nBins - 1, 1
	}
	bits := math.Float64bits(a)
	oct := int(bits>>52&0x7ff) - 1023
	m := math.Float64frombits(bits&^(0x7ff<<52) | 1023<<52) // in [1, 2)
	k := 0
	if m >= thirds[1] {
		k = 1
	}
	if m >= thirds[2] {
		k = 2
	}
	return 1 + binsPerOctave*oct + k, (m - thirds[k]) / (thirds[k+1] - thirds[k])
}

// thirds are the edges of the thirds of an octave: 1, 2^(1/3), 2^(2/3), 2.
var thirds = [4]float64{1, 1.2599210498948732, 1.5874010519682994, 2}

// seconds is d in seconds.
func seconds(d time.Duration) float64 { return d.Seconds() }

// fromSeconds is s seconds as a Duration, rounded to the millisecond.
func fromSeconds(s float64) time.Duration {
	return time.Duration(math.Round(s*1e3)) * time.Millisecond
}
