package kvroute_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// metricsFront fronts a decode engine and rewrites its /metrics as mode
// says, once mode is set: "overflow" (num_gpu_blocks whose capacity in
// tokens overflows int64 to 8), "tiny" (a capacity of 8 tokens),
// "future" (a process start a day ahead), "usage" (a KV usage of 750%).
type metricsFront struct {
	mode  atomic.Value // string
	proxy *httputil.ReverseProxy
	url   string
}

func newMetricsFront(t *testing.T, e *kvroutetest.Engine) *metricsFront {
	u, err := url.Parse(e.URL())
	require.NoError(t, err)
	f := &metricsFront{proxy: httputil.NewSingleHostReverseProxy(u)}
	f.mode.Store("")
	f.url = newServer(t, f)
	return f
}

func (f *metricsFront) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	mode := f.mode.Load().(string)
	if r.URL.Path != "/metrics" || mode == "" {
		f.proxy.ServeHTTP(w, r)
		return
	}
	rec := &bytes.Buffer{}
	f.proxy.ServeHTTP(&bufferWriter{h: http.Header{}, buf: rec}, r)
	var out strings.Builder
	sc := bufio.NewScanner(rec)
	sc.Buffer(make([]byte, 0, 1<<16), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.HasPrefix(line, "vllm:cache_config_info{") && mode == "overflow":
			// (2^61+1) blocks of 8 tokens: 2^64 + 8 tokens.
			line = `vllm:cache_config_info{block_size="8",engine="0",num_gpu_blocks="2305843009213693954"} 1.0`
		case strings.HasPrefix(line, "vllm:cache_config_info{") && mode == "tiny":
			line = `vllm:cache_config_info{block_size="16",engine="0",kv_cache_size_tokens="8",num_gpu_blocks="2"} 1.0`
		case strings.HasPrefix(line, "process_start_time_seconds ") && mode == "future":
			line = fmt.Sprintf("process_start_time_seconds %d", time.Now().Add(24*time.Hour).Unix())
		case strings.HasPrefix(line, "vllm:kv_cache_usage_perc{") && mode == "usage":
			line = line[:strings.LastIndexByte(line, ' ')] + " 7.5"
		}
		out.WriteString(line + "\n")
	}
	w.Header().Set("Content-Type", "text/plain; version=0.0.4")
	_, _ = io.WriteString(w, out.String())
}

// bufferWriter is a ResponseWriter into a buffer.
type bufferWriter struct {
	h   http.Header
	buf *bytes.Buffer
}

func (b *bufferWriter) Header() http.Header         { return b.h }
func (b *bufferWriter) Write(p []byte) (int, error) { return b.buf.Write(p) }
func (b *bufferWriter) WriteHeader(int)             {}

// A decode engine whose /metrics turns absurd (a KV capacity that
// overflows to 8 tokens, a capacity of 8 tokens, a process start a day
// ahead, a usage of 750%) does not turn reuse off: each absurd value is
// ignored and counted (Stats.ImplausibleMetrics), the last good one kept,
// and every later turn of the conversation still reuses, with the single
// engine's answer.
func TestImplausibleMetricsIgnored(t *testing.T) {
	for _, mode := range []string{"overflow", "tiny", "future", "usage"} {
		t.Run(mode, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1)
			front := newMetricsFront(t, c.Decode[0])
			r, err := kvroute.New(kvroute.WithPrefill(c.Prefill[0].URL()), kvroute.WithDecode(front.url), kvroute.WithThreshold(0),
				kvroute.WithDecodeMemory(kvroute.DecodeMemory{Budget: 0.5, MetricsInterval: time.Millisecond}),
				kvroute.WithHealth(kvroute.Health{RestartCheck: time.Nanosecond}))
			require.NoError(t, err)
			t.Cleanup(func() { _ = r.Close() })
			url := serve(t, r)
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 16,
				messages: []message{{Role: "system", Content: systemPrompt}}}
			capacity := func() int64 {
				for _, kv := range r.DecodeKV() {
					if kv.Endpoint == front.url {
						return kv.Capacity
					}
				}
				return 0
			}
			// Each turn reads the engine's /metrics (the restart check
			// before a hit, the pressure reading beside it unless one is
			// in flight): after two good turns the engine turns absurd,
			// and the conversation goes on until three absurd readings
			// were made, each later turn a hit.
			for turn := 0; turn < 2 || r.Stats().ImplausibleMetrics < 3; turn++ {
				require.Less(t, turn, 50, "absurd readings made: %d", r.Stats().ImplausibleMetrics)
				if turn == 2 {
					require.Eventually(t, func() bool { return capacity() > 0 }, 5*time.Second, time.Millisecond, "a good reading first")
					front.mode.Store(mode)
				}
				conv.say(userText(turn))
				body := conv.body()
				res := post(t, url, kvroute.PathChatCompletions, body, nil)
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
				assert.Equal(t, reference(t, kvroute.PathChatCompletions, body), res.text, "turn %d", turn)
				if turn >= 2 {
					assert.Equal(t, "hit", res.header.Get("X-Bidikv-Reuse"), "turn %d", turn)
				}
				conv.hear(res.text)
			}
			good := int64(kvroutetest.DefaultNumBlocks * kvroutetest.DefaultBlockSize)
			assert.Equal(t, good, capacity(), "the last good capacity stands")
			assert.Zero(t, r.Stats().RestartedHandles)
		})
	}
}
