package redisstore_test

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/retention/redisstore"
)

// The end-to-end tests run several conversations at once, turn by turn,
// through router replicas in front of simulated engines, each turn of each
// conversation on a replica picked at random.
const (
	e2eConversations = 6
	e2eTurns         = 10
	e2eMaxTokens     = 16
)

// e2eFleet is a set of router replicas over one cluster of engines.
type e2eFleet struct {
	cluster *kvroutetest.Cluster
	urls    []string
	client  *http.Client
}

func newFleet(t *testing.T, stores []kvroute.Store) *e2eFleet {
	t.Helper()
	c := kvroutetest.NewCluster(t, 2, 2, kvroutetest.WithStreamHandles(true))
	var endpoints []kvroute.Option
	for _, e := range c.Prefill {
		endpoints = append(endpoints, kvroute.WithPrefill(e.URL()))
	}
	for _, e := range c.Decode {
		endpoints = append(endpoints, kvroute.WithDecode(e.URL()))
	}
	f := &e2eFleet{cluster: c, client: &http.Client{Transport: &http.Transport{}}}
	t.Cleanup(f.client.CloseIdleConnections)
	for _, s := range stores {
		r, err := kvroute.New(append(endpoints, kvroute.WithStore(s))...)
		require.NoError(t, err)
		srv := httptest.NewServer(r)
		t.Cleanup(func() { srv.Close(); _ = r.Close() })
		f.urls = append(f.urls, srv.URL)
	}
	return f
}

type chatMessage struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// e2eSystem makes the first turn long enough (well over the engines'
// kv_recompute_threshold of 64 tokens) for the second turn to be a hit.
var e2eSystem = strings.Repeat("Answer briefly, cite the file and line you mean, and never invent a tool result. ", 8)

// e2eConversation resends its whole history every turn, as vLLM's
// multi-turn benchmark does, with a conversation_id.
type e2eConversation struct {
	id       string
	stream   bool
	rng      *rand.Rand
	messages []chatMessage
}

func newConversations() []*e2eConversation {
	convs := make([]*e2eConversation, e2eConversations)
	for i := range convs {
		convs[i] = &e2eConversation{
			id:       fmt.Sprint("conversation-", i),
			stream:   i%2 == 0,
			rng:      rand.New(rand.NewPCG(uint64(i), 42)),
			messages: []chatMessage{{Role: "system", Content: fmt.Sprintf("You are assistant number %d. ", i) + e2eSystem}},
		}
	}
	return convs
}

func (c *e2eConversation) body() []byte {
	b, err := json.Marshal(map[string]any{
		"model": kvroutetest.DefaultModel, "messages": c.messages, "max_tokens": e2eMaxTokens,
		"stream": c.stream, "conversation_id": c.id,
	})
	if err != nil {
		panic(err)
	}
	return b
}

// turn sends the conversation's next turn to a random replica, checks the
// answer against the single-engine reference and returns the reuse outcome
// the router reported.
func (f *e2eFleet) turn(t *testing.T, c *e2eConversation, n int) (reuse string, ok bool) {
	c.messages = append(c.messages, chatMessage{Role: "user", Content: fmt.Sprintf(
		"Turn %d of %s: summarise what we said so far and add one new idea about item %d.", n, c.id, n*7)})
	body := c.body()
	want, err := kvroutetest.Reference(kvroute.PathChatCompletions, body)
	if !assert.NoError(t, err) {
		return "", false
	}
	url := f.urls[c.rng.IntN(len(f.urls))]
	resp, err := f.client.Post(url+kvroute.PathChatCompletions, "application/json", bytes.NewReader(body))
	if !assert.NoError(t, err, "%s turn %d", c.id, n) {
		return "", false
	}
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	if !assert.NoError(t, err, "%s turn %d", c.id, n) ||
		!assert.Equal(t, http.StatusOK, resp.StatusCode, "%s turn %d: %s", c.id, n, raw) {
		return "", false
	}
	text, err := replyText(raw, c.stream)
	if !assert.NoError(t, err, "%s turn %d: %s", c.id, n, raw) ||
		!assert.Equal(t, want.Text, text, "%s turn %d: answer differs from the single-engine reference", c.id, n) {
		return "", false
	}
	c.messages = append(c.messages, chatMessage{Role: "assistant", Content: text})
	return resp.Header.Get("X-Bidikv-Reuse"), true
}

// replyText returns the assistant content of a chat completion body or
// stream; a stream must end with [DONE] and carry no error event.
func replyText(raw []byte, stream bool) (string, error) {
	type choice struct {
		Message struct{ Content string } `json:"message"`
		Delta   struct{ Content string } `json:"delta"`
	}
	if !stream {
		var b struct{ Choices []choice }
		if err := json.Unmarshal(raw, &b); err != nil || len(b.Choices) == 0 {
			return "", fmt.Errorf("not a completion: %v", err)
		}
		return b.Choices[0].Message.Content, nil
	}
	var text strings.Builder
	sc := bufio.NewScanner(bytes.NewReader(raw))
	sc.Buffer(nil, 1<<20)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		switch {
		case !ok:
		case data == "[DONE]":
			return text.String(), nil
		default:
			var ev struct {
				Choices []choice
				Error   json.RawMessage
			}
			if err := json.Unmarshal([]byte(data), &ev); err != nil || ev.Error != nil {
				return "", fmt.Errorf("bad event %s: %v", data, err)
			}
			for _, c := range ev.Choices {
				text.WriteString(c.Delta.Content)
			}
		}
	}
	return "", fmt.Errorf("stream ended without [DONE]")
}

// round runs turn n of every conversation at once and returns how many
// were hits, misses and failures.
func (f *e2eFleet) round(t *testing.T, convs []*e2eConversation, n int) (hits, misses, failed int) {
	var mu sync.Mutex
	var wg sync.WaitGroup
	for _, c := range convs {
		wg.Go(func() {
			reuse, ok := f.turn(t, c, n)
			mu.Lock()
			defer mu.Unlock()
			switch {
			case !ok:
				failed++
			case reuse == string(kvroute.ReuseHit):
				hits++
			default:
				misses++
			}
		})
	}
	wg.Wait()
	return hits, misses, failed
}

// checkEngines asserts that no engine served a read of freed or expired
// blocks (a handle used twice) or an output that differs from the
// reference.
func (f *e2eFleet) checkEngines(t *testing.T) {
	for _, e := range append(append([]*kvroutetest.Engine(nil), f.cluster.Prefill...), f.cluster.Decode...) {
		st := e.Stats()
		assert.Zero(t, st.FreedReads, "reads of freed blocks: a handle was used twice")
		assert.Zero(t, st.ExpiredReads, "reads of expired blocks")
		assert.Zero(t, st.WrongOutputs, "outputs differing from the reference")
	}
}

// e2eStores returns n Stores on srv, each with its own client as separate
// processes would have. The timeout is generous: these tests check hit
// rates and answers, and a loaded CI machine must not turn a slow call into
// a miss. A dead Redis still fails at once: NewFromURL does not retry.
func e2eStores(t *testing.T, srv *server, n int) []*redisstore.Store {
	stores := make([]*redisstore.Store, n)
	for i := range stores {
		stores[i] = newStore(t, srv, redisstore.WithTimeout(2*time.Second))
	}
	return stores
}

func asStores(ss []*redisstore.Store) []kvroute.Store {
	out := make([]kvroute.Store, len(ss))
	for i, s := range ss {
		out[i] = s
	}
	return out
}

// TestReplicas compares one router with its in-memory store against three
// replicas sharing one Redis, on the same workload.
func TestReplicas(t *testing.T) {
	srv := startServer(t)
	stores := e2eStores(t, srv, 3)
	runs := []struct {
		name  string
		fleet func(t *testing.T) *e2eFleet
	}{
		{"single replica, memory", newFleetDefault},
		{"three replicas, redis", func(t *testing.T) *e2eFleet { return newFleet(t, asStores(stores)) }},
	}
	hitsPerTurn := make([][]int, len(runs))
	for i, run := range runs {
		t.Run(run.name, func(t *testing.T) {
			f := run.fleet(t)
			convs := newConversations()
			for n := 1; n <= e2eTurns; n++ {
				hits, _, failed := f.round(t, convs, n)
				require.Zero(t, failed, "turn %d", n)
				hitsPerTurn[i] = append(hitsPerTurn[i], hits)
			}
			f.checkEngines(t)
		})
	}
	want := []int{0}
	for range e2eTurns - 1 {
		want = append(want, e2eConversations)
	}
	assert.Equal(t, want, hitsPerTurn[0], "single replica: every turn after the first is a hit")
	assert.Equal(t, hitsPerTurn[0], hitsPerTurn[1], "three replicas on Redis: the same hits per turn as one replica")

	var sum redisstore.Stats
	for _, s := range stores {
		st := s.Stats()
		sum.Hits += st.Hits
		sum.Puts += st.Puts
		sum.TakeErrors += st.TakeErrors
		sum.PutErrors += st.PutErrors
	}
	assert.Equal(t, int64(e2eConversations*(e2eTurns-1)), sum.Hits, "one take per hit, never two")
	assert.Equal(t, int64(e2eConversations*e2eTurns), sum.Puts)
	assert.Zero(t, sum.TakeErrors+sum.PutErrors)
}

// newFleetDefault is one router with its default in-memory store.
func newFleetDefault(t *testing.T) *e2eFleet {
	t.Helper()
	c := kvroutetest.NewCluster(t, 2, 2, kvroutetest.WithStreamHandles(true))
	var opts []kvroute.Option
	for _, e := range c.Prefill {
		opts = append(opts, kvroute.WithPrefill(e.URL()))
	}
	for _, e := range c.Decode {
		opts = append(opts, kvroute.WithDecode(e.URL()))
	}
	r, err := kvroute.New(opts...)
	require.NoError(t, err)
	srv := httptest.NewServer(r)
	f := &e2eFleet{cluster: c, urls: []string{srv.URL}, client: &http.Client{Transport: &http.Transport{}}}
	t.Cleanup(func() { f.client.CloseIdleConnections(); srv.Close(); _ = r.Close() })
	return f
}

// TestReplicasRedisRestart kills Redis while a round of turns is in flight,
// runs a round with Redis down and then starts an empty one on the same
// port: no client sees an error, the turns in between miss, and hits
// resume.
func TestReplicasRedisRestart(t *testing.T) {
	const killAt = 5 // the round during which Redis goes away
	srv := startServer(t)
	stores := e2eStores(t, srv, 3)
	f := newFleet(t, asStores(stores))
	convs := newConversations()

	for n := 1; n < killAt; n++ {
		hits, _, failed := f.round(t, convs, n)
		require.Zero(t, failed, "turn %d", n)
		assert.Equal(t, min(n-1, 1)*e2eConversations, hits, "turn %d", n)
	}

	killed := make(chan struct{})
	go func() { defer close(killed); srv.kill() }()
	_, _, failed := f.round(t, convs, killAt)
	<-killed
	require.Zero(t, failed, "Redis killed mid-round: a client saw an error")

	hits, misses, failed := f.round(t, convs, killAt+1)
	require.Zero(t, failed, "Redis down: a client saw an error")
	assert.Equal(t, [2]int{0, e2eConversations}, [2]int{hits, misses}, "Redis down: every turn misses")

	srv.restart()
	probeErrs := 0
	for _, s := range stores {
		probeErrs += waitRecovered(t, s)
	}
	hits, misses, failed = f.round(t, convs, killAt+2)
	require.Zero(t, failed)
	assert.Equal(t, [2]int{0, e2eConversations}, [2]int{hits, misses},
		"the restarted Redis is empty and the turn before could not store")
	for n := killAt + 3; n <= e2eTurns; n++ {
		hits, _, failed := f.round(t, convs, n)
		require.Zero(t, failed, "turn %d", n)
		assert.Equal(t, e2eConversations, hits, "turn %d: hits resume", n)
	}
	f.checkEngines(t)

	var st redisstore.Stats
	for _, s := range stores {
		st.TakeErrors += s.Stats().TakeErrors
		st.PutErrors += s.Stats().PutErrors
	}
	assert.GreaterOrEqual(t, st.TakeErrors, int64(e2eConversations+probeErrs), "a failed take per turn while Redis was down")
	assert.GreaterOrEqual(t, st.PutErrors, int64(e2eConversations), "a failed put per turn while Redis was down")
}
