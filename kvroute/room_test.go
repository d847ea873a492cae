package kvroute_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Issue 23 ("with free memory, holding costs nothing"; "no preemption
// caused by holds while the live working set fits"): holds may fill the
// decode memory the live requests do not need, and room is made when a
// request arrives. A decode engine of budgetBlocks blocks, a Budget that
// lets holds take all of it (or most), and more single-turn
// conversations than its memory holds: each new turn's decode leg finds
// the engine full of holds. The router releases the holds worth least
// when the leg arrives, D frees them by the notify-only path at that
// moment (not at the TTL: the clock never moves), the engine admits the
// leg, and every answer, of the released conversations' next turns too,
// is a single engine's. Before room was made on arrival the turn that
// found D full waited for the holds' TTL.
func TestRoomOnArrival(t *testing.T) {
	for _, tc := range []struct {
		name   string
		path   string
		stream bool
		mem    kvroute.DecodeMemory
	}{
		{"chat/budget-1", kvroute.PathChatCompletions, false, kvroute.DecodeMemory{Budget: 1}},
		{"chat/stream/budget-0.9", kvroute.PathChatCompletions, true, kvroute.DecodeMemory{Budget: 0.9}},
		{"completions/budget-1/headroom-0.2", kvroute.PathCompletions, false, kvroute.DecodeMemory{Budget: 1, Headroom: 0.2}},
		{"completions/stream/budget-0.95/releases-1", kvroute.PathCompletions, true, kvroute.DecodeMemory{Budget: 0.95, Releases: 1}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, r, srv, front := budgetRig(t, "", kvroute.WithDecodeMemory(tc.mem))
			d := c.Decode[0]
			var convs []*conversation
			for i := range 12 {
				// Prompts that share no prefix: D's prefix cache shares no
				// block between the holds.
				own := fmt.Sprintf("Conversation %d. %s", i, systemPrompt)
				conv := &conversation{path: tc.path, stream: tc.stream, maxTok: 16}
				if tc.path == kvroute.PathChatCompletions {
					conv.messages = []message{{Role: "system", Content: own}}
				} else {
					conv.prompt = own
				}
				conv.say(userText(i))
				conv.hear(roomTurn(t, c, srv, conv))
				convs = append(convs, conv)
				if i == 0 {
					knowCapacity(t, r)
				}
			}
			settle(t, r, func(s kvroute.Stats) bool {
				return requested(s)+s.ReleaseFailures+s.ReleaseGone >= int64(front.releases.Load())
			})
			s, st := r.Stats(), d.Stats()
			assert.Positive(t, s.ReleasedRoom, "room was made")
			assert.Zero(t, s.ReleaseFailures)
			assert.EqualValues(t, requested(s), st.NotifiedHolds, "D freed every victim at its release")
			assert.Zero(t, st.TTLExpiries, "no hold lapsed: the clock never moved")
			// (A leg D admits before a release lands may be preempted when
			// it grows, as vLLM would, and is recomputed once the blocks
			// are freed: the release is asynchronous, never on the turn's
			// path. The fleet benchmark measures none.)
			assert.LessOrEqual(t, st.Preemptions, 2, "at most a release in flight's")
			kv := r.DecodeKV()[0]
			assert.LessOrEqual(t, kv.HeldTokens, kv.Budget, "the holds stay within the budget")
			// The conversations come back: released ones miss, kept ones
			// hit; every answer is a single engine's.
			for i, conv := range convs {
				conv.say(userText(i + 1))
				roomTurn(t, c, srv, conv)
			}
			assert.Zero(t, d.Stats().WrongOutputs)
			assert.Zero(t, d.Stats().TTLExpiries)
			assert.Equal(t, []int64{0}, kvroute.LiveTokens(r), "every leg that ended left the live count")
		})
	}
}

// roomTurn sends conv's turn and checks its answer against a single
// engine's. A turn still unanswered after a generous bound waits on D
// for the holds' TTL: the test fails, and the clock is moved past the
// TTL so that the turn ends.
func roomTurn(t *testing.T, c *kvroutetest.Cluster, srv string, conv *conversation) string {
	t.Helper()
	body := conv.body()
	type answer struct {
		res turnResult
		err error
	}
	done := make(chan answer, 1)
	go func() {
		resp, err := http.Post(srv+conv.path, "application/json", bytes.NewReader(body))
		if err != nil {
			done <- answer{err: err}
			return
		}
		defer resp.Body.Close()
		raw, err := io.ReadAll(resp.Body)
		done <- answer{res: turnResult{status: resp.StatusCode, header: resp.Header, raw: raw}, err: err}
	}()
	var a answer
	select {
	case a = <-done:
	case <-time.After(20 * time.Second): // a hang detector, not a timing assertion
		t.Errorf("the turn waited on D behind holds (D: %+v)", c.Decode[0].Stats())
		c.Clock.Advance(kvroute.Defaults().TTLs.DecoderBlocks + time.Second)
		a = <-done
	}
	require.NoError(t, a.err)
	require.Equal(t, http.StatusOK, a.res.status, "%s", a.res.raw)
	var text string
	if strings.HasPrefix(a.res.header.Get("Content-Type"), "text/event-stream") {
		text, _ = parseStream(t, a.res.raw)
	} else {
		text, _ = parseBody(t, a.res.raw)
	}
	want, err := kvroutetest.Reference(conv.path, body)
	require.NoError(t, err)
	assert.Equal(t, want.Text, text, "the answer differs from a single engine's")
	return text
}

// A decode leg counts live on its engine while D works on it, and no
// longer once its answer is whole: what D still holds of it is then the
// hold its retain adds to the ledger. A leg that fits beside the holds
// (within capacity less the headroom and within the budget) makes no room
// and, retained, releases nothing. Before, the leg still counted live
// until its Response was released, and a release started meanwhile made
// room for the leg that had just ended as well: it released more holds,
// or not, as its goroutine ran before or after the turn's end (the fleet
// benchmark's managed arm then printed one release more in some runs than
// in others). A streamed answer held open after its last event shows it
// every time; a non-streamed one showed it in some runs.
func TestFinishedLegLeavesLiveBeforeRetain(t *testing.T) {
	for _, stream := range []bool{true, false} {
		t.Run(fmt.Sprintf("stream=%v", stream), func(t *testing.T) {
			c, r, srv, front := budgetRig(t, "")
			// Conversations that share no block (a shared prompt is
			// counted once).
			distinctTurns(t, r, srv, 2)
			// The two holds wait: worth less than a new one.
			c.Clock.Advance(2 * time.Minute)
			kv := r.DecodeKV()[0]
			require.Zero(t, r.Stats().ReleasedBudget)
			held := kv.HeldTokens
			require.Less(t, held, kv.Budget, "two holds fit the budget")
			// A new conversation whose leg may take what the holds leave
			// under capacity less the headroom, within the budget: no
			// room made on arrival.
			conv := &conversation{path: kvroute.PathChatCompletions, stream: stream, maxTok: 1,
				messages: []message{{Role: "system", Content: "Conversation 3. " + systemPrompt}}}
			// (a longer prompt than theirs: its hold is larger than any of
			// them)
			conv.say("Conversation 3. " + userText(3) + " " + userText(4))
			probe, err := kvroutetest.Reference(conv.path, conv.body())
			require.NoError(t, err)
			limit := min(int64(float64(kv.Capacity)*(1-kvroute.Defaults().DecodeMemory.Headroom)), kv.Budget)
			conv.maxTok = int(limit - held - int64(probe.PromptTokens))
			require.Positive(t, conv.maxTok, "the leg fits beside the holds")
			body := conv.body()
			want, err := kvroutetest.Reference(conv.path, body)
			require.NoError(t, err)
			resp, err := r.Do(context.Background(), &kvroute.Request{Path: conv.path, Header: http.Header{}, Body: body})
			require.NoError(t, err)
			var out bytes.Buffer
			if stream {
				// Read to the last event, [DONE]: the answer is whole and
				// retained; the Response is not released yet.
				for {
					ev, err := resp.Next()
					require.NoError(t, err)
					out.Write(ev)
					if bytes.Contains(ev, []byte("[DONE]")) {
						break
					}
				}
			}
			assert.Greater(t, r.DecodeKV()[0].HeldTokens+requested(r.Stats()), int64(0), "retained")
			assert.Equal(t, []int64{0}, kvroute.LiveTokens(r), "the finished leg no longer counts live")
			// Any release chosen ends (none is due).
			settle(t, r, func(s kvroute.Stats) bool {
				return requested(s)+s.ReleaseFailures+s.ReleaseGone >= int64(front.releases.Load())
			})
			s := r.Stats()
			assert.Zero(t, s.ReleasedRoom, "no room made on arrival")
			assert.Zero(t, s.ReleasedBudget, "the holds fit the budget")
			assert.Equal(t, 3, r.DecodeKV()[0].Handles)
			assert.LessOrEqual(t, r.DecodeKV()[0].HeldTokens, kv.Budget)
			assert.Zero(t, front.releases.Load())
			_, err = resp.WriteTo(&out)
			require.NoError(t, err)
			require.NoError(t, resp.Close())
			parse := parseBody
			if stream {
				parse = parseStream
			}
			text, _ := parse(t, out.Bytes())
			assert.Equal(t, want.Text, text, "the answer is a single engine's")
			assert.Equal(t, []int64{0}, kvroute.LiveTokens(r), "the leg left the live count once")
		})
	}
}
