package kvroute_test

import (
	"context"
	"net/http"
	"regexp"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/internal/entry"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention"
)

// corruptStore hands back every entry with the first block id of its
// handle replaced by id, stored compacted as a router stores it: another
// router, or the store, wrote a list the router did not write.
type corruptStore struct {
	kvroute.Store
	id string
}

var firstBlockID = regexp.MustCompile(`("remote_block_ids":\[\[)[0-9]+`)

func (s *corruptStore) Take(ctx context.Context, key string) ([]byte, bool, error) {
	v, ok, err := s.Store.Take(ctx, key)
	if !ok || err != nil {
		return v, ok, err
	}
	e, err := entry.Decode(v, nil)
	if err != nil {
		return v, ok, nil
	}
	e.Handle = firstBlockID.ReplaceAll(e.Handle, []byte("${1}"+s.id))
	e.Blocks.End = 0 // Decode's, about the text before the edit
	return e.Encode(nil, nil), true, nil
}

// A retained handle's block list is taken without being read again only
// when the router's own expansion of the store entry wrote it within
// range: an entry whose compacted ids decode outside 0..2^31-1 is refused
// as invalid before any prefill engine sees it.
func TestRetainedBlockIDsOutOfRangeRefused(t *testing.T) {
	for _, id := range []string{"2147483648", "4294967296"} {
		t.Run(id, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
			mem, err := retention.NewMemory()
			require.NoError(t, err)
			obs := &kvroutetest.Records{}
			r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(c.Decode[0].URL()),
				kvroute.WithStore(&corruptStore{Store: mem, id: id}), kvroute.WithObserver(obs))
			require.NoError(t, err)
			t.Cleanup(func() { _ = r.Close() })
			url := serve(t, r)
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
			for i := range 2 {
				conv.say(userText(i))
				body := conv.body()
				res := post(t, url, conv.path, body, nil)
				require.Equal(t, http.StatusOK, res.status, "turn %d: %s", i, res.raw)
				assert.Equal(t, reference(t, conv.path, body), res.text, "turn %d", i)
				conv.hear(res.text)
			}
			assert.Equal(t, kvroute.MissBadEntry, obs.Last().MissReason)
			assert.Equal(t, int64(1), r.Stats().InvalidHandles)
			assert.Empty(t, attachedHandles(t, c.Prefill[0]), "an out-of-range block id reached a prefill engine")
		})
	}
}
