package decodemem

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// A decode leg that ended counts at the readings, in whole blocks, until
// its hold is added (Retained), and at most at the two readings that
// follow its end when no hold comes (a refused retain, a broken leg).
func TestEndedLegsCountUntilRetained(t *testing.T) {
	var p Pressure
	var live int64 = 300 // the ledger's live legs
	leave := func(n int64) func() { return func() { live -= n } }
	var seen int64
	begin := func() int64 { return p.Begin(func() { seen = live }) }

	p.Ended(100, 16, leave(100)) // 7 blocks
	p.Ended(40, 0, leave(40))    // block size unknown: as counted
	assert.EqualValues(t, 160, live)
	assert.EqualValues(t, 112+40, begin(), "ended before the reading, not retained yet")
	assert.EqualValues(t, 160, seen, "the snapshot ran under the same lock")

	p.Retained(func() {}) // one of them: of average size
	assert.EqualValues(t, 76, begin(), "the other, at the reading after")
	assert.Zero(t, begin(), "no longer: its hold never came")

	p.Ended(32, 16, leave(32))
	p.Retained(func() {})
	p.Retained(func() {}) // nothing left to end
	assert.Zero(t, begin(), "retained before the reading")
}
