package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The concurrency oracle: many conversations at once on all four APIs,
// streaming and not, on several keys, through the proxy with its default
// flags, while a share of the clients go away at a random point (halfway
// through sending the body, while the turn is in prefill or decode, in the
// middle of the stream). Every answer a client reads whole must be a
// single engine's answer to that client's own request (never another
// tenant's, never corrupted) and a 200: a client that left must cost the
// others nothing. Afterwards the proxy holds no body bytes, no body in
// transit and no turn; the package's goleak check covers goroutines, and
// under make test (build tag bidikv_bufcheck) every pooled buffer released
// twice, read or written after its release fails loudly.
func TestConcurrencyOracle(t *testing.T) {
	for _, tc := range []struct {
		name    string
		handles bool // the engines' chat streams carry D's handle (PR #40186)
	}{{"stream handles", true}, {"stock engines", false}} {
		t.Run(tc.name, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 2, 2, kvroutetest.WithStreamHandles(tc.handles))
			keys := []string{"sk-oracle-a", "sk-oracle-b", "sk-oracle-c"}
			args := []string{"--prefill", cl.Prefill[0].URL(), "--prefill", cl.Prefill[1].URL(),
				"--decode", cl.Decode[0].URL(), "--decode", cl.Decode[1].URL()}
			for _, k := range keys {
				args = append(args, "--api-key", k)
			}
			p := startInProcess(t, nil, args...)
			o := &oracle{base: p.url, addr: p.addr, keys: keys, until: time.Now().Add(oracleDuration)}
			t.Run("clients", func(t *testing.T) {
				for w := range oracleWorkers {
					t.Run(strconv.Itoa(w), func(t *testing.T) {
						t.Parallel()
						o.worker(t, uint64(w))
					})
				}
			})
			t.Logf("%d answers checked (%d hits); clients gone: %d while sending the body, %d as soon as it was sent, %d before the answer, %d in the stream",
				o.answered.Load(), o.hits.Load(), o.left[leftInBody].Load(), o.left[leftAfterBody].Load(),
				o.left[leftBeforeAnswer].Load(), o.left[leftInStream].Load())
			assert.Positive(t, o.answered.Load())
			assert.Positive(t, o.hits.Load(), "conversations reuse between the departures")
			for i := range o.left {
				assert.Positive(t, o.left[i].Load(), "clients left at point %d", i)
			}
			// Nothing of the clients that left is held.
			for _, g := range []string{"bidikv_buffered_request_bytes", "bidikv_request_bodies_in_transit", "bidikv_inflight_turns"} {
				var v string
				for range 500 {
					if v = p.metric(t, g); v == "0" {
						break
					}
					time.Sleep(10 * time.Millisecond)
				}
				assert.Equal(t, "0", v, "%s after every client is done", g)
			}
		})
	}
}

const (
	oracleWorkers  = 8
	oracleDuration = 4 * time.Second
	oracleTurns    = 3
	oracleLeave    = 0.25 // the share of requests whose client goes away
)

// Where a client goes away.
const (
	leftInBody       = iota // with part of its body sent
	leftAfterBody           // as soon as its body is sent
	leftBeforeAnswer        // after sending it, before the answer is read (prefill, decode)
	leftInStream            // after reading part of a stream
	leavePoints
)

type oracle struct {
	base, addr string
	keys       []string
	until      time.Time
	answered   atomic.Int64
	hits       atomic.Int64
	left       [leavePoints]atomic.Int64
}

// worker runs conversations until the oracle's time is up.
func (o *oracle) worker(t *testing.T, w uint64) {
	rng := rand.New(rand.NewPCG(w, 28))
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	paths := []string{"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}
	for n := 0; time.Now().Before(o.until); n++ {
		c := newTenantConv(paths[rng.IntN(len(paths))], rng.IntN(2) == 0)
		key := o.keys[rng.IntN(len(o.keys))]
		for turn := range oracleTurns {
			c.ask(fmt.Sprintf("Worker %d, conversation %d, turn %d: tell me about %s.", w, n, turn, key))
			for {
				if rng.Float64() < oracleLeave {
					o.leave(t, client, c, key, rng)
					continue
				}
				o.answer(t, client, c, key)
				break
			}
		}
	}
}

// request builds the conversation's next request with key.
func (o *oracle) request(ctx context.Context, t *testing.T, c *tenantConv, key string) (*http.Request, []byte) {
	body := c.body()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, o.base+c.path, bytes.NewReader(body))
	require.NoError(t, err)
	req.Header = c.header()
	req.Header.Set("Authorization", "Bearer "+key)
	return req, body
}

// answer sends the conversation's turn and checks the answer whole: a 200,
// equal to a single engine's answer to the same request.
func (o *oracle) answer(t *testing.T, client *http.Client, c *tenantConv, key string) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	req, body := o.request(ctx, t, c, key)
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, resp.StatusCode, "%s: %s", c.path, b)
	want, err := kvroutetest.Reference(c.path, body)
	require.NoError(t, err)
	require.Equal(t, want.Text, c.heard(t, b), "%s (stream %v): the answer to this client's own request", c.path, c.stream)
	o.answered.Add(1)
	if resp.Header.Get("X-Bidikv-Reuse") == "hit" {
		o.hits.Add(1)
	}
}

// leave sends the conversation's turn and goes away at a random point.
func (o *oracle) leave(t *testing.T, client *http.Client, c *tenantConv, key string, rng *rand.Rand) {
	// As soon as the body is sent (a client's timeout, Esc in Claude
	// Code) twice as often as each other point.
	point := rng.IntN(leavePoints + 1)
	if point == leavePoints {
		point = leftAfterBody
	}
	if point == leftInStream && !c.stream {
		point = leftBeforeAnswer
	}
	if point == leftInBody || point == leftAfterBody {
		o.leaveInBody(t, c, key, point == leftAfterBody, rng)
		o.left[point].Add(1)
		return
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	req, _ := o.request(ctx, t, c, key)
	if point == leftBeforeAnswer {
		// Gone after a random moment: in prefill, in decode, or (the
		// turn was faster) with the answer's headers read.
		time.AfterFunc(time.Duration(rng.IntN(8000))*time.Microsecond, cancel)
	}
	resp, err := client.Do(req)
	if err != nil {
		require.ErrorIs(t, err, context.Canceled)
		o.left[point].Add(1)
		return
	}
	defer resp.Body.Close()
	if point == leftInStream {
		_, _ = io.CopyN(io.Discard, resp.Body, int64(1+rng.IntN(600)))
	}
	cancel()
	o.left[point].Add(1)
}

// leaveInBody sends the headers and part of the body (all of it when
// whole) on a connection of its own, then closes it.
func (o *oracle) leaveInBody(t *testing.T, c *tenantConv, key string, whole bool, rng *rand.Rand) {
	body := c.body()
	conn, err := net.DialTimeout("tcp", o.addr, 5*time.Second)
	require.NoError(t, err)
	defer conn.Close()
	require.NoError(t, conn.SetDeadline(time.Now().Add(10*time.Second)))
	var head strings.Builder
	fmt.Fprintf(&head, "POST %s HTTP/1.1\r\nHost: %s\r\nContent-Length: %d\r\nAuthorization: Bearer %s\r\n", c.path, o.addr, len(body), key)
	h := c.header()
	h.Del("Content-Length")
	require.NoError(t, h.Write(&head))
	head.WriteString("\r\n")
	_, err = io.WriteString(conn, head.String())
	require.NoError(t, err)
	if whole {
		_, err = conn.Write(body)
		require.NoError(t, err)
		return
	}
	_, err = conn.Write(body[:rng.IntN(len(body))])
	require.NoError(t, err)
	// Sometimes long enough for the proxy's read to block first.
	time.Sleep(time.Duration(rng.IntN(3000)) * time.Microsecond)
}
