package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Bodies trickled from many addresses, or from one address with the
// per-address bound off (a proxy behind a load balancer), fill every slot
// of --max-bodies-in-transit (512) and keep trickling, one byte a second.
// Well-behaved clients are all served, each answer the single engine's:
// each of their bodies takes the slot of the slowest trickled body (below
// --min-body-rate after its first second), which is answered 408 in the
// API's error shape. The bodies in transit never exceed the bound.
func TestTrickledBodiesShedNoOne(t *testing.T) {
	for _, tc := range []struct {
		name  string
		addrs int
		args  []string
	}{
		{name: "17 addresses", addrs: 17},
		{name: "one address, per-address bound off", addrs: 1, args: []string{"--max-client-bodies-in-transit", "0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cl := kvroutetest.NewCluster(t, 1, 1)
			p := startInProcess(t, nil, append([]string{"--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL()}, tc.args...)...)
			const attackers, good = 544, 24
			conns := make([]net.Conn, attackers)
			for i := range conns {
				conns[i] = dialFrom(t, p, fmt.Sprintf("127.0.0.%d", 2+i%tc.addrs))
				require.NoError(t, conns[i].SetDeadline(time.Now().Add(time.Minute)))
				trickle(t, conns[i], "/v1/chat/completions", 100_000, 1)
			}
			waitMetric(t, p, "bidikv_request_bodies_in_transit", func(v int) bool { return v == defaultMaxTransit })

			// One byte a second on every trickled body.
			stop, trickled := make(chan struct{}), make(chan struct{})
			go func() {
				defer close(trickled)
				tick := time.NewTicker(time.Second)
				defer tick.Stop()
				for {
					select {
					case <-stop:
						return
					case <-tick.C:
					}
					for _, c := range conns {
						_, _ = c.Write([]byte(" "))
					}
				}
			}()
			defer func() { close(stop); <-trickled }()

			time.Sleep(bodyRateGrace + 100*time.Millisecond)
			// The well-behaved clients at once, each on a connection of
			// its own and each body in two parts 100 ms apart: each needs
			// a slot while the others are in transit.
			var wg sync.WaitGroup
			for range good {
				wg.Go(func() { servedInParts(t, p, 100*time.Millisecond) })
			}
			wg.Wait()
			cutN, _ := strconv.Atoi(p.metric(t, "bidikv_slow_bodies_cut_total"))
			assert.GreaterOrEqual(t, cutN, 1)
			// Each body that took a slot cut one: a well-behaved one, or
			// (on a machine slow enough that the attack's own last bodies
			// came after the first ones' grace) one of the attack's.
			assert.LessOrEqual(t, cutN, good+attackers-defaultMaxTransit)
			waitMetric(t, p, `bidikv_rejected_requests_total{reason="body_too_slow",status="408"}`, func(v int) bool { return v == cutN })
			n, _ := strconv.Atoi(p.metric(t, "bidikv_request_bodies_in_transit"))
			assert.LessOrEqual(t, n, defaultMaxTransit)

			// The trickled bodies that were cut got 408 in OpenAI's error
			// shape; the others, refused at the start (503) or still in
			// transit.
			var mu sync.Mutex
			cut, refused := 0, 0
			for _, c := range conns {
				wg.Go(func() {
					require.NoError(t, c.SetReadDeadline(time.Now().Add(2*time.Second)))
					resp, err := http.ReadResponse(bufio.NewReader(c), nil)
					if err != nil {
						return // still in transit
					}
					defer resp.Body.Close()
					mu.Lock()
					defer mu.Unlock()
					switch resp.StatusCode {
					case http.StatusRequestTimeout:
						cut++
						assert.True(t, resp.Close, "Connection: close")
					case http.StatusServiceUnavailable:
						refused++
					default:
						t.Errorf("a trickled body got %d", resp.StatusCode)
					}
				})
			}
			wg.Wait()
			assert.Equal(t, cutN, cut)
			t.Logf("%d trickled bodies cut for %d well-behaved requests, %d refused at the start", cut, good, refused)
			assert.LessOrEqual(t, refused, attackers-defaultMaxTransit)
		})
	}
}

// servedInParts sends goodChat as a well-behaved client on a connection
// of its own, its body in two parts pause apart, and checks that it gets
// 200 with the single engine's answer.
func servedInParts(t *testing.T, p *inproc, pause time.Duration) {
	t.Helper()
	half := len(goodChat) / 2
	body := io.MultiReader(strings.NewReader(goodChat[:half]), pauseReader(pause), strings.NewReader(goodChat[half:]))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, p.url+"/v1/chat/completions", body)
	require.NoError(t, err)
	req.ContentLength = int64(len(goodChat))
	req.Header.Set("Content-Type", "application/json")
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	resp, err := tr.RoundTrip(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	if !assert.Equal(t, http.StatusOK, resp.StatusCode, "a well-behaved client during the attack: %s", b) {
		return
	}
	var out struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	require.NoError(t, json.Unmarshal(b, &out), string(b))
	require.Len(t, out.Choices, 1)
	assert.Equal(t, reference(t, []byte(goodChat)), out.Choices[0].Message.Content)
}

// pauseReader reads nothing, once, after d.
type pauseReader time.Duration

func (p pauseReader) Read([]byte) (int, error) {
	time.Sleep(time.Duration(p))
	return 0, io.EOF
}

// The answer to a body cut below --min-body-rate, in the error shape of
// its API.
func TestSlowBodyCutAnswer(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1)
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL(),
		"--max-bodies-in-transit", "2", "--max-client-bodies-in-transit", "0")
	for _, path := range []string{"/v1/chat/completions", "/v1/messages"} {
		slow := p.dial(t)
		trickle(t, slow, path, 1000, 1)
		other := p.dial(t)
		trickle(t, other, "/v1/chat/completions", 1000, 1)
		waitMetric(t, p, "bidikv_request_bodies_in_transit", func(v int) bool { return v == 2 })
		time.Sleep(bodyRateGrace)
		_, err := other.Write([]byte("                                                  ")) // 51 bytes: the other is faster
		require.NoError(t, err)
		waitMetric(t, p, "bidikv_buffered_request_bytes", func(v int) bool { return v == 52 })
		assertServed(t, p, 1)
		resp, body := rawResponse(t, bufio.NewReader(slow))
		if path == "/v1/messages" {
			assertAnthropicError(t, resp.StatusCode, resp.Header, body, http.StatusRequestTimeout, "invalid_request_error")
		} else {
			assertJSONError(t, resp.StatusCode, resp.Header, body, http.StatusRequestTimeout, "request_timeout")
		}
		assert.Contains(t, body, "--min-body-rate")
		require.NoError(t, other.Close())
		waitMetric(t, p, "bidikv_request_bodies_in_transit", func(v int) bool { return v == 0 })
	}
}
