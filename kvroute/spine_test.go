package kvroute_test

import (
	"bytes"
	"context"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/threshold"
)

// spine keeps every turn's record itself (not a copy), so that a test can
// count, after the turn, every retain and end the turn ran: an end that
// ran again after the Observer saw the record shows there. Turns run on
// the test's goroutine (Router.Do), so reading them afterwards is safe.
type spine struct {
	mu   sync.Mutex
	recs map[string]*kvroute.TurnRecord
}

func (s *spine) ObserveTurn(rec *kvroute.TurnRecord) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.recs == nil {
		s.recs = map[string]*kvroute.TurnRecord{}
	}
	s.recs[rec.RequestID] = rec
}

func (s *spine) take(t *testing.T, id string) *kvroute.TurnRecord {
	t.Helper()
	s.mu.Lock()
	defer s.mu.Unlock()
	rec, ok := s.recs[id]
	require.True(t, ok, "turn %s never ended", id)
	delete(s.recs, id)
	return rec
}

// spineTurn is one turn sent through Router.Do: how the caller reads it
// (whole, or one event and Close: the client gone), and its record.
type spineTurn struct {
	t    *testing.T
	r    *kvroute.Router
	obs  *spine
	conv *conversation
	n    int
}

// next sends the conversation's next turn and reads its answer whole,
// checking it against the single-engine reference; failed: the turn may
// fail. It returns the record, whose retain and end ran exactly once, the
// retain only for a turn that answered whole.
func (s *spineTurn) next(failed bool) *kvroute.TurnRecord {
	t := s.t
	t.Helper()
	s.n++
	id := fmt.Sprintf("spine-%d", s.n)
	s.conv.say(userText(s.n))
	body := s.conv.body()
	resp, err := s.r.Do(context.Background(), &kvroute.Request{Path: s.conv.path, Header: http.Header{"X-Request-Id": {id}}, Body: body})
	if err == nil {
		var buf bytes.Buffer
		_, err = resp.WriteTo(&buf)
		require.NoError(t, resp.Close())
		require.NoError(t, resp.Close(), "a second Close ends nothing again")
		if err == nil {
			var text string
			if resp.Streaming() {
				text, _ = parseStream(t, buf.Bytes())
			} else {
				text, _ = parseBody(t, buf.Bytes())
			}
			require.Equal(t, reference(t, s.conv.path, body), text, "turn %d", s.n)
			s.conv.hear(text)
		}
	}
	rec := s.obs.take(t, id)
	require.Equal(t, failed, err != nil, "turn %d: %v", s.n, err)
	if failed {
		s.conv.messages = s.conv.messages[:len(s.conv.messages)-1]
	}
	s.calls(rec, !failed)
	return rec
}

// gone sends the next turn as a stream, reads its first event and closes
// it: the client went.
func (s *spineTurn) gone() *kvroute.TurnRecord {
	t := s.t
	t.Helper()
	s.n++
	id := fmt.Sprintf("spine-%d", s.n)
	s.conv.say(userText(s.n))
	resp, err := s.r.Do(context.Background(), &kvroute.Request{Path: s.conv.path, Header: http.Header{"X-Request-Id": {id}}, Body: s.conv.body()})
	require.NoError(t, err)
	_, err = resp.Next()
	require.NoError(t, err)
	require.NoError(t, resp.Close())
	require.NoError(t, resp.Close())
	s.conv.messages = s.conv.messages[:len(s.conv.messages)-1]
	rec := s.obs.take(t, id)
	s.calls(rec, false)
	assert.Equal(t, kvroute.RefuseClosedEarly, rec.StoreRefusal)
	assert.NoError(t, rec.Err, "a client that goes is no failure")
	return rec
}

func (s *spineTurn) calls(rec *kvroute.TurnRecord, whole bool) {
	s.t.Helper()
	retain, end := kvroute.TurnCalls(rec)
	want := 0
	if whole {
		want = 1
	}
	assert.Equal(s.t, want, retain, "turn %d (%s %s): retain calls", s.n, rec.Reuse, rec.MissReason)
	assert.Equal(s.t, 1, end, "turn %d (%s %s): end calls", s.n, rec.Reuse, rec.MissReason)
}

func newSpine(t *testing.T, c *kvroutetest.Cluster, stream bool, opts ...kvroute.Option) *spineTurn {
	obs := &spine{}
	r := newRouter(t, c, append([]kvroute.Option{kvroute.WithObserver(obs)}, opts...)...)
	conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 16, messages: []message{{Role: "system", Content: systemPrompt}}}
	return &spineTurn{t: t, r: r, obs: obs, conv: conv}
}

// TestTurnSpine: every turn runs its retain phase once when its answer is
// whole (never when it is not) and ends exactly once, on every path: a
// miss, a hit, a redone turn, a buffered stream, decode-local turns and a
// failed one, a failure before and after the answer began, a client that
// goes mid-stream. Every answer is the single engine's.
func TestTurnSpine(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
			s := newSpine(t, c, stream)
			assert.Equal(t, kvroute.ReuseMiss, s.next(false).Reuse)
			assert.Equal(t, kvroute.ReuseHit, s.next(false).Reuse)
			c.Decode[0].FailNext(1, http.StatusServiceUnavailable)
			rec := s.next(false)
			assert.Equal(t, kvroute.MissRetry, rec.MissReason, "redone as a plain miss")
			c.Decode[0].FailNext(1, http.StatusBadRequest)
			assert.Equal(t, kvroute.PhaseDecode, s.next(true).ErrPhase)
			c.Prefill[0].FailNext(1, http.StatusBadRequest)
			assert.Equal(t, kvroute.PhasePrefill, s.next(true).ErrPhase)
			assert.True(t, s.next(false).Stored)
			if stream {
				c.Decode[0].CutStreamAfter(3)
				assert.Equal(t, kvroute.PhaseStream, s.next(true).ErrPhase)
				s.gone()
			}
			assert.True(t, s.next(false).Stored)
		})
	}
}

// TestTurnSpineBuffered: a buffered stream (stock engines' streams carry no
// handle) retains and ends once, written by WriteTo.
func TestTurnSpineBuffered(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	s := newSpine(t, c, true, kvroute.WithDecodeMemory(kvroute.DecodeMemory{BufferStreams: []string{kvroute.PathChatCompletions}}))
	for range 3 {
		s.next(false)
	}
	rec := s.next(false)
	assert.True(t, rec.Buffered)
	assert.Equal(t, kvroute.ReuseHit, rec.Reuse)
}

// TestTurnSpineLocal: decode-local turns, and one whose decode-local leg
// failed and ran again as a plain miss, retain and end once.
func TestTurnSpineLocal(t *testing.T) {
	for _, stream := range []bool{false, true} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
			s := newSpine(t, c, stream, kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true, KVBytesPerToken: 1000}),
				kvroute.WithThresholdPolicy(localModel(t, threshold.CostConfig{MaxLocalSuffix: 400})))
			require.True(t, s.next(false).Stored)
			assert.Equal(t, kvroute.ReuseLocal, s.next(false).Reuse)
			c.Decode[0].FailNext(1, http.StatusServiceUnavailable)
			rec := s.next(false)
			assert.Equal(t, kvroute.MissRetry, rec.MissReason, "the failed decode-local leg ran again as a plain miss")
			assert.Equal(t, threshold.PathLocal, rec.Choice)
			s.conv.say(strings.Repeat("go test output line with a failing assertion ", 60))
			assert.Equal(t, kvroute.ReuseHit, s.next(false).Reuse)
		})
	}
}

// TestTurnSpineClosed: a turn refused before any phase (the Router is
// closed) ends once.
func TestTurnSpineClosed(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	s := newSpine(t, c, false)
	require.NoError(t, s.r.Close())
	assert.ErrorIs(t, s.next(true).Err, kvroute.ErrClosed)
}

// TestTurnSpineObserved: a streamed turn that pulls its handle is reported
// to a learning Chooser when it ends with what its phases handed on,
// which the record shows too: the path, the decode engine, the prompt's
// and the verified tokens, the prefill phase's time.
func TestTurnSpineObserved(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	l := &learner{CostModel: localModel(t, threshold.CostConfig{MaxLocalSuffix: 400})}
	s := newSpine(t, c, true, kvroute.WithDecodeMemory(kvroute.DecodeMemory{Local: true}), kvroute.WithThresholdPolicy(l))
	require.True(t, s.next(false).Stored)
	s.conv.say(strings.Repeat("go test output line with a failing assertion ", 60))
	rec := s.next(false)
	require.Equal(t, threshold.PathPull, rec.Choice)
	l.mu.Lock()
	defer l.mu.Unlock()
	require.Len(t, l.obs, 1, "turn 2 had a verified handle")
	o := l.obs[0]
	assert.Equal(t, threshold.PathPull, o.Path)
	assert.Equal(t, rec.DecodeEndpoint, o.Decode)
	assert.Equal(t, rec.PromptTokens, o.PromptTokens)
	assert.Equal(t, rec.VerifiedTokens, o.ReusableTokens)
	assert.Positive(t, o.Prefill)
	assert.Equal(t, rec.Prefill, o.Prefill)
	assert.Positive(t, o.DecodeFirst)
	assert.LessOrEqual(t, o.DecodeFirst, rec.TTFT)
}
