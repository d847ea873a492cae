package main

import (
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/transport"
)

func TestDNSFlags(t *testing.T) {
	c, err := parseConfig([]string{"--prefill-dns", "_http._tcp.vllm-prefill.llm.svc.cluster.local",
		"--decode-dns", "https://vllm-decode.llm.svc.cluster.local:8000", "--decode-dp-size", "4", "--dns-refresh", "2s"}, noEnv, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, "_http._tcp.vllm-prefill.llm.svc.cluster.local", c.dns.prefill)
	assert.Equal(t, 4, c.dns.decodeDP)
	assert.Equal(t, 1, c.dns.prefillDP)
	assert.Equal(t, 2*time.Second, c.dns.refresh)

	for _, bad := range [][]string{
		{"--prefill-dns", "p.test:8100", "--prefill", "http://p:1"},
		{"--prefill-dns", "p.test:8100", "--prefiller-hosts", "p"},
		{"--decode-dns", "d.test:8200", "--decoder-ports", "8201"},
		{"--decode-dns", "d.test"},
		{"--decode-dns", "_http._tcp.d.test:8200"},
		{"--decode-dns", "d.test:8200", "--dns-refresh", "0s"},
		{"--decode-dns", "d.test:8200", "--decode-dp-size", "0"},
		{"--decode-dp-size", "2"},
	} {
		_, err := parseConfig(bad, noEnv, io.Discard)
		assert.ErrorIs(t, err, errUsage, "%q", bad)
	}
}

// fixedDNS answers every host with the given addresses.
type fixedDNS []string

func (f fixedDNS) LookupHost(context.Context, string) ([]string, error) { return f, nil }
func (f fixedDNS) LookupSRV(context.Context, string, string, string) (string, []*net.SRV, error) {
	return "", nil, &net.DNSError{Err: "no such host", IsNotFound: true}
}

func TestResolveDNSSetsURLs(t *testing.T) {
	c, err := parseConfig([]string{"--prefill-dns", "p.test:8100", "--decode-dns", "d.test:8200", "--decode-dp-size", "2"}, noEnv, io.Discard)
	require.NoError(t, err)
	require.NoError(t, resolveDNS(context.Background(), c, fixedDNS{"10.0.0.2", "10.0.0.1"}, newLogger(c, io.Discard)))
	assert.Equal(t, []string{"http://10.0.0.1:8100", "http://10.0.0.2:8100"}, c.prefillURLs)
	assert.Equal(t, []string{"http://10.0.0.1:8200", "http://10.0.0.2:8200"}, c.decodeURLs, "one URL per address, for probes and logs")
	require.Len(t, c.dns.initial[roleDecode], 4, "two ranks per decode address")
	assert.Equal(t, 1, c.dns.initial[roleDecode][1].Rank)

	// No engine yet: resolveDNS waits, until shutdown.
	c, err = parseConfig([]string{"--decode-dns", "d.test:8200", "--dns-refresh", "1ms"}, noEnv, io.Discard)
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	var logs syncBuffer
	done := make(chan error, 1)
	go func() { done <- resolveDNS(ctx, c, fixedDNS{}, newLogger(c, &logs)) }()
	for i := 0; i < 1000 && !strings.Contains(logs.String(), "waiting for engines in DNS"); i++ {
		time.Sleep(5 * time.Millisecond)
	}
	cancel()
	err = <-done
	require.Error(t, err)
	assert.Contains(t, err.Error(), "no engine found before shutdown")
	assert.Equal(t, 1, strings.Count(logs.String(), "waiting for engines in DNS"), "logged once")
}

// TestProxyDNS runs the proxy with both pools given by DNS names (IP
// literals, which the standard resolver answers without a DNS server) and
// a decode engine with two data-parallel ranks: turns get the reference
// answer, decode legs are pinned to ranks, and the discovery metrics are
// exported.
func TestProxyDNS(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithDPSize(2))
	hostPort := func(e *kvroutetest.Engine) string {
		u, err := url.Parse(e.URL())
		require.NoError(t, err)
		return u.Host
	}
	ctx, cancel := context.WithCancel(context.Background())
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	done := make(chan error, 1)
	args := []string{"--host", "127.0.0.1", "--port", "0", "--health-interval", "1h",
		"--prefill-dns", hostPort(c.Prefill[0]), "--decode-dns", "http://" + hostPort(c.Decode[0]),
		"--decode-dp-size", "2", "--dns-refresh", "10ms"}
	go func() { done <- run(ctx, args, noEnv, stdout, stderr) }()
	client := &http.Client{Transport: &http.Transport{}}
	defer func() {
		client.CloseIdleConnections()
		cancel()
		select {
		case err := <-done:
			assert.NoError(t, err)
		case <-time.After(30 * time.Second):
			t.Error("the proxy did not stop")
		}
		if t.Failed() {
			t.Logf("stderr:\n%s", stderr.String())
		}
	}()
	var base string
	for i := 0; i < 1000 && base == ""; i++ {
		if m := proxyReady.FindStringSubmatch(stdout.String()); m != nil {
			base = m[1]
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	require.NotEmpty(t, base, "the proxy did not start: %s", stderr.String())

	msgs := []map[string]string{{"role": "user", "content": "List the files of the repository, then read the README and summarise it."}}
	for i := range 4 {
		body, err := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": 8, "messages": msgs})
		require.NoError(t, err)
		want, err := kvroutetest.Reference(kvroute.PathChatCompletions, body)
		require.NoError(t, err)
		resp, err := client.Post(base+kvroute.PathChatCompletions, "application/json", bytes.NewReader(body))
		require.NoError(t, err)
		raw, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		require.NoError(t, err)
		require.Equal(t, http.StatusOK, resp.StatusCode, "%s", raw)
		var out struct {
			Choices []struct {
				Message struct{ Content string } `json:"message"`
			} `json:"choices"`
		}
		require.NoError(t, json.Unmarshal(raw, &out))
		require.Len(t, out.Choices, 1)
		assert.Equal(t, want.Text, out.Choices[0].Message.Content, "turn %d", i)
		msgs = append(msgs, map[string]string{"role": "assistant", "content": out.Choices[0].Message.Content},
			map[string]string{"role": "user", "content": "Turn " + strconv.Itoa(i) + ": now run the tests."})
	}
	for _, r := range c.Decode[0].Requests() {
		if r.Role == "decode" {
			assert.Contains(t, []string{"0", "1"}, r.Header.Get(transport.RankHeader), "decode legs are pinned to a rank")
		}
	}

	resp, err := client.Get(base + "/ready")
	require.NoError(t, err)
	_ = resp.Body.Close()
	assert.Equal(t, http.StatusOK, resp.StatusCode)
	var metrics string
	for i := 0; i < 500; i++ { // the watcher's first refresh starts with the server
		resp, err = client.Get(base + "/metrics")
		require.NoError(t, err)
		b, _ := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		if metrics = string(b); strings.Contains(metrics, `bidikv_dns_endpoints{role="decode"} 2`) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	assert.Contains(t, metrics, `bidikv_dns_endpoints{role="decode"} 2`)
	assert.Contains(t, metrics, `bidikv_dns_endpoints{role="prefill"} 1`)
	assert.Contains(t, metrics, `bidikv_dns_failures_total{role="decode"} 0`)
}
