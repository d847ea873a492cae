package kvroute_test

import (
	"context"
	"net/http"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// chargeLedger is a WithLimits ChargeAnswer that records what it holds.
type chargeLedger struct {
	mu                sync.Mutex
	held, peak, calls int64
	refuse            bool
	ctxOK             bool
}

func (l *chargeLedger) charge(ctx context.Context, n int64) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.calls++
	l.ctxOK = ctx.Value(ctxMark{}) == "turn"
	if n > 0 && l.refuse {
		return false
	}
	l.held += n
	l.peak = max(l.peak, l.held)
	return true
}

func (l *chargeLedger) state() (held, peak, calls int64) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.held, l.peak, l.calls
}

type ctxMark struct{}

// markContext puts ctxMark in every request's context, to show the
// ChargeAnswer gets the turn's.
type markContext struct{ h http.Handler }

func (m markContext) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	m.h.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), ctxMark{}, "turn")))
}

// WithLimits' ChargeAnswer is charged every decode answer the router holds
// (a non-streaming answer, a buffered stream's) with the turn's context
// before it is held, and all of it is given back when the response is
// closed; a stream passed through is never charged. The answers are the
// single engine's.
func TestChargeAnswer(t *testing.T) {
	for _, tc := range []struct {
		name    string
		path    string
		stream  bool
		buffer  []string
		charged bool
	}{
		{name: "chat", path: kvroute.PathChatCompletions, charged: true},
		{name: "messages", path: kvroute.PathMessages, charged: true},
		{name: "messages buffered stream", path: kvroute.PathMessages, stream: true, buffer: []string{kvroute.PathMessages}, charged: true},
		{name: "chat stream passed through", path: kvroute.PathChatCompletions, stream: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1)
			l := &chargeLedger{}
			r := newRouter(t, c, kvroute.WithLimits(kvroute.Limits{ChargeAnswer: l.charge}),
				kvroute.WithDecodeMemory(kvroute.DecodeMemory{BufferStreams: tc.buffer}))
			url := newServer(t, markContext{leakGuard{t: t, h: r}})
			body := convBody(t, tc.path, tc.stream, 0, 24, nil, nil)
			res := send(t, url, tc.path, body, nil)
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			ref, err := kvroutetest.Reference(tc.path, body)
			require.NoError(t, err)
			switch {
			case tc.stream:
				assert.Equal(t, ref.Text, readStream(t, res.raw).text)
			case tc.path == kvroute.PathMessages:
				text, _ := agentText(t, tc.path, res.raw, false)
				assert.Equal(t, ref.Text, text)
			default:
				text, _ := parseBody(t, res.raw)
				assert.Equal(t, ref.Text, text)
			}
			require.Eventually(t, func() bool { h, _, _ := l.state(); return h == 0 }, 5*time.Second, time.Millisecond,
				"every byte charged is given back once the response is closed")
			_, peak, calls := l.state()
			if !tc.charged {
				assert.Zero(t, calls)
				return
			}
			assert.True(t, l.ctxOK, "called with the turn's context")
			assert.GreaterOrEqual(t, calls, int64(2), "the answer's bytes, then their return")
			if !tc.stream {
				// The engine's answer, of which the client got all but the handle.
				assert.Greater(t, peak, int64(len(res.raw)))
			}
			assert.Less(t, peak, int64(len(res.raw))+4096)
		})
	}
}

// An answer ChargeAnswer refuses fails its turn with 503 and Retry-After in
// the API's error shape, once: the turn is not redone on the other decode
// engine, and nothing stays charged.
func TestChargeAnswerRefused(t *testing.T) {
	for _, path := range []string{kvroute.PathChatCompletions, kvroute.PathMessages} {
		t.Run(path, func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 2)
			l := &chargeLedger{refuse: true}
			r := newRouter(t, c, kvroute.WithLimits(kvroute.Limits{ChargeAnswer: l.charge}))
			url := serve(t, r)
			res := send(t, url, path, convBody(t, path, false, 0, 24, nil, nil), nil)
			assert.Equal(t, http.StatusServiceUnavailable, res.status, "%s", res.raw)
			assert.Equal(t, "1", res.header.Get("Retry-After"))
			assert.Contains(t, string(res.raw), "ChargeAnswer")
			if path == kvroute.PathMessages {
				assert.Contains(t, string(res.raw), `"type":"error"`)
			} else {
				assert.Contains(t, string(res.raw), `"error":{`)
			}
			legs := 0
			for _, e := range c.Decode {
				legs += len(roleRecords(e, "decode"))
			}
			assert.Equal(t, 1, legs, "not redone")
			held, _, _ := l.state()
			assert.Zero(t, held)
		})
	}
}
