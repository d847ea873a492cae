package kvroute

import (
	"testing"

	"github.com/stretchr/testify/assert"
)

// Every retained entry keeps the code of the API its turn was served on,
// in the Store (Redis included), and a release request reads it back: the
// codes are pinned, so that entries stored by an earlier version keep
// their meaning whatever the order of apis.
func TestAPICodes(t *testing.T) {
	pinned := map[string]byte{
		PathChatCompletions: 1,
		PathCompletions:     2,
		PathResponses:       3,
		PathMessages:        4,
	}
	for path, code := range pinned {
		assert.Equal(t, code, apiCode(path), "%s's code is persisted: never renumber it", path)
	}
	assert.Len(t, apis, len(pinned), "a new API takes a code no API has had, and is pinned here")
	assert.Zero(t, apiCode("/v1/unknown"), "0 is unknown")
	checkRegistry(t)
}

// checkRegistry checks what makes the registry sound: each API has a
// kind, a path and a code of its own (0 is unknown).
func checkRegistry(t *testing.T) {
	t.Helper()
	codes, paths := map[byte]string{}, map[string]bool{}
	for _, a := range apis {
		assert.NotZero(t, a.code, "%s: a code is required (0 is unknown)", a.path)
		if other, ok := codes[a.code]; ok {
			assert.Failf(t, "two APIs share a code", "%s and %s: code %d", other, a.path, a.code)
		}
		codes[a.code] = a.path
		assert.False(t, paths[a.path], "%s registered twice", a.path)
		paths[a.path] = true
		assert.Contains(t, []apiKind{twoLegs, passThrough}, a.kind, "%s: a kind is required", a.path)
		assert.NotNil(t, a.impl, "%s: an impl is required", a.path)
		if a.kind == twoLegs {
			assert.NotEmpty(t, a.prefillSet, "%s: a two-leg API's prefill leg rewrite", a.path)
		}
	}
}
