package kvroute_test

import (
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// A decode engine whose /metrics carry no vllm:cache_config_info (vLLM
// run with --disable-log-stats) has no known KV capacity, and decode
// memory management is off for it. That is not silent: the router reads
// the engine's /metrics at start (before any turn), warns once with the
// fix (DecodeMemory's Capacity, the proxy's --decode-kv-capacity), counts
// it and names it in the engine's status. With Capacity set, the
// management is on for the engine, with no warning.
func TestUnknownCapacityNamed(t *testing.T) {
	const capacity = 64 * 16
	for _, configured := range []int64{0, capacity} {
		t.Run(fmt.Sprintf("capacity %d", configured), func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true), kvroutetest.WithNumBlocks(64))
			logs := &syncBuffer{}
			d := noCacheInfo(t, c.Decode[0])
			r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(d),
				kvroute.WithLogger(slog.New(slog.NewTextHandler(logs, nil))),
				kvroute.WithDecodeMemory(kvroute.DecodeMemory{Capacity: configured}))
			require.NoError(t, err)
			t.Cleanup(func() { _ = r.Close() })
			if configured == 0 {
				for i := 0; i < 5000 && r.Stats().CapacityUnknown == 0; i++ {
					time.Sleep(time.Millisecond)
				}
				assert.EqualValues(t, 1, r.Stats().CapacityUnknown, "counted at start, before any turn")
				st := r.Endpoints(kvroute.PhaseDecode)[0]
				assert.Contains(t, st.NoCapacity, "vllm:cache_config_info", "the engine's status names it")
				log := logs.String()
				assert.Equal(t, 1, strings.Count(log, "KV capacity is unknown"), "logged once: %s", log)
				assert.Contains(t, log, "--decode-kv-capacity", "with the fix")
				assert.Contains(t, log, "endpoint="+d, "naming the engine")
			}
			srv := serve(t, r)
			for i := range 3 { // more readings: no second warning
				conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
				conv.say(fmt.Sprintf("Conversation %d. %s", i, userText(i)))
				releaseTurn(t, srv, conv.path, conv.body(), nil)
			}
			kv := r.DecodeKV()[0]
			if configured == 0 {
				assert.EqualValues(t, 1, r.Stats().CapacityUnknown)
				assert.Equal(t, 1, strings.Count(logs.String(), "KV capacity is unknown"))
				assert.Zero(t, kv.Budget, "management off for the engine")
				return
			}
			assert.EqualValues(t, capacity, kv.Capacity)
			assert.Positive(t, kv.Budget, "management on for the engine")
			assert.Positive(t, kv.HeldTokens)
			assert.Zero(t, r.Stats().CapacityUnknown)
			assert.Empty(t, r.Endpoints(kvroute.PhaseDecode)[0].NoCapacity)
			assert.NotContains(t, logs.String(), "KV capacity is unknown")
		})
	}
}
