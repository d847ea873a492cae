package kvroute_test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"net/http"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// TestRandomConversations runs 1,000 random conversations with random
// client-side mutations of their history through the simulated engines:
// no answer may differ from the single-engine reference, and unmutated
// continuations must hit.
func TestRandomConversations(t *testing.T) {
	if testing.Short() {
		t.Skip("long property test")
	}
	c := kvroutetest.NewCluster(t, 1, 1)
	// Threshold 0: attach every continuing handle, however short (the
	// engine still applies its own threshold), so every unmutated
	// continuation is a hit.
	r := newRouter(t, c, kvroute.WithThreshold(0))
	const conversations = 1000
	var (
		mu                        sync.Mutex
		continuations, hits, muts int
		wrong                     int
	)
	work := make(chan int)
	var wg sync.WaitGroup
	for range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for seed := range work {
				cont, hit, mut, bad := randomConversation(t, r, seed)
				mu.Lock()
				continuations += cont
				hits += hit
				muts += mut
				wrong += bad
				mu.Unlock()
			}
		}()
	}
	for i := range conversations {
		work <- i
	}
	close(work)
	wg.Wait()
	t.Logf("%d conversations: %d unmutated continuations, %d hits, %d mutated turns, %d wrong answers", conversations, continuations, hits, muts, wrong)
	assert.Zero(t, wrong)
	require.Positive(t, continuations)
	assert.GreaterOrEqual(t, float64(hits)/float64(continuations), 0.99)
	for _, e := range []*kvroutetest.Engine{c.Prefill[0], c.Decode[0]} {
		assert.Zero(t, e.Stats().WrongOutputs)
		assert.Zero(t, e.Stats().FreedReads)
	}
}

func randomConversation(t *testing.T, r *kvroute.Router, seed int) (continuations, hits, mutated, wrong int) {
	rng := rand.New(rand.NewPCG(uint64(seed), 7))
	tenant := fmt.Sprintf("Bearer tenant-%d", rng.IntN(3))
	msgs := []message{{Role: "system", Content: fmt.Sprintf("%s You are agent %d.", systemPrompt, rng.IntN(5))}}
	turns := 2 + rng.IntN(3)
	stored := false
	for turn := 0; turn < turns; turn++ {
		mutation := ""
		if turn > 0 && rng.IntN(4) == 0 {
			mutation = []string{"edit", "strip", "reorder", "truncate", "tenant"}[rng.IntN(5)]
			switch mutation {
			case "edit":
				i := rng.IntN(len(msgs))
				msgs[i].Content += " (edited)"
			case "strip":
				for i := len(msgs) - 1; i >= 0; i-- {
					if msgs[i].Role == "assistant" && len(msgs[i].Content) > 3 {
						msgs[i].Content = msgs[i].Content[:len(msgs[i].Content)/2]
						break
					}
				}
			case "reorder":
				if len(msgs) > 2 {
					msgs[1], msgs[2] = msgs[2], msgs[1]
				}
			case "truncate":
				if len(msgs) > 2 {
					msgs = msgs[2:]
				}
			case "tenant":
				tenant += "-other"
			}
		}
		msgs = append(msgs, message{Role: "user", Content: fmt.Sprintf("step %d of task %d: %d", turn, seed, rng.IntN(1000))})
		conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 4 + rng.IntN(20), messages: msgs}
		body := conv.body()
		resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Body: body,
			Header: http.Header{"Authorization": {tenant}}})
		require.NoError(t, err)
		assert.NotContains(t, string(resp.Body), "kv_transfer_params")
		text, _ := parseBody(t, resp.Body)
		_ = resp.Close()
		if text != reference(t, kvroute.PathChatCompletions, body) {
			wrong++
		}
		if mutation != "" {
			mutated++
			// Reordering or truncating may recreate a history stored
			// earlier in the conversation; an edit never can.
			if mutation == "edit" || mutation == "strip" || mutation == "tenant" {
				assert.Equal(t, kvroute.ReuseMiss, resp.Reuse(), "mutation %s must not hit", mutation)
			}
		} else if stored {
			continuations++
			if resp.Reuse() == kvroute.ReuseHit {
				hits++
			}
		}
		stored = true
		msgs = append(msgs, message{Role: "assistant", Content: text})
	}
	return continuations, hits, mutated, wrong
}
