package kvroute_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Extension example: a Store is one file and one registration line
// (WithStore): mapStore (example_store_test.go) keeps handles in a map and
// passes kvroutetest.TestStore.
func TestExtendStore(t *testing.T) {
	kvroutetest.TestStore(t, func(*testing.T) kvroute.Store { return newMapStore(time.Now) })

	c := kvroutetest.NewCluster(t, 1, 1)
	store := newMapStore(time.Now)
	rec := &kvroutetest.Records{}
	url := serve(t, newRouter(t, c, kvroute.WithStore(store), kvroute.WithObserver(rec), kvroute.WithThreshold(0))) // the registration line
	conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 8}
	for i := range 3 {
		conv.say(userText(i))
		res := post(t, url, conv.path, conv.body(), nil)
		require.Equal(t, http.StatusOK, res.status)
		conv.hear(res.text)
		if i > 0 {
			assert.Equal(t, kvroute.ReuseHit, rec.Last().Reuse, "turn %d reuses the handle the map kept (%s)", i, rec.Last().MissReason)
		}
		assert.True(t, rec.Last().Stored)
	}
	store.mu.Lock()
	assert.Len(t, store.vals, 1, "the conversation's live handle")
	store.mu.Unlock()
}
