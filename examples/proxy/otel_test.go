package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	commonpb "go.opentelemetry.io/proto/otlp/common/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// collector is an OTLP/HTTP traces receiver on 127.0.0.1, a stand-in for
// an OpenTelemetry Collector: it decodes every export request and keeps
// its spans with their resource.
type collector struct {
	url string

	mu       sync.Mutex
	requests int
	spans    []exported
	bad      []string
}

type exported struct {
	service string
	span    *tracepb.Span
}

func newCollector(t *testing.T) *collector {
	c := &collector{}
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, err := io.ReadAll(io.LimitReader(r.Body, 16<<20))
		var req coltracepb.ExportTraceServiceRequest
		c.mu.Lock()
		defer c.mu.Unlock()
		c.requests++
		switch {
		case r.Method != http.MethodPost || r.URL.Path != "/v1/traces":
			c.bad = append(c.bad, r.Method+" "+r.URL.Path)
		case r.Header.Get("Content-Type") != "application/x-protobuf":
			c.bad = append(c.bad, "content type "+r.Header.Get("Content-Type"))
		case err != nil:
			c.bad = append(c.bad, err.Error())
		default:
			if err := proto.Unmarshal(body, &req); err != nil {
				c.bad = append(c.bad, err.Error())
				break
			}
			for _, rs := range req.ResourceSpans {
				service := attrString(rs.GetResource().GetAttributes(), "service.name")
				for _, ss := range rs.ScopeSpans {
					for _, s := range ss.Spans {
						c.spans = append(c.spans, exported{service: service, span: s})
					}
				}
			}
		}
		out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
		w.Header().Set("Content-Type", "application/x-protobuf")
		_, _ = w.Write(out)
	}))
	t.Cleanup(srv.Close)
	c.url = srv.URL
	return c
}

func attrString(kvs []*commonpb.KeyValue, key string) string {
	for _, kv := range kvs {
		if kv.Key == key {
			return attrText(kv.Value)
		}
	}
	return ""
}

func attrText(v *commonpb.AnyValue) string {
	switch x := v.GetValue().(type) {
	case *commonpb.AnyValue_StringValue:
		return x.StringValue
	case *commonpb.AnyValue_IntValue:
		return fmt.Sprint(x.IntValue)
	case *commonpb.AnyValue_BoolValue:
		return fmt.Sprint(x.BoolValue)
	case *commonpb.AnyValue_DoubleValue:
		return fmt.Sprintf("%.3f", x.DoubleValue)
	}
	return v.String()
}

// runProxy runs the proxy in this process with getenv until stop is
// called; stop waits for run to return (the drain and the span flush).
func runProxy(t *testing.T, getenv func(string) string, args ...string) (url string, stop func() error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	args = append([]string{"--host", "127.0.0.1", "--port", "0", "--health-interval", "1h"}, args...)
	done := make(chan error, 1)
	go func() { done <- run(ctx, args, getenv, stdout, stderr) }()
	stopped := false
	stop = func() error {
		if stopped {
			return nil
		}
		stopped = true
		cancel()
		select {
		case err := <-done:
			return err
		case <-time.After(30 * time.Second):
			return fmt.Errorf("the proxy did not stop")
		}
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Error(err)
		}
		if t.Failed() {
			t.Logf("proxy stderr:\n%s", stderr.String())
		}
	})
	for range 1000 {
		if m := proxyReady.FindStringSubmatch(stdout.String()); m != nil {
			return m[1], stop
		}
		select {
		case err := <-done:
			done <- err
			require.FailNow(t, "the proxy stopped", "%v\n%s", err, stderr.String())
		case <-time.After(10 * time.Millisecond):
		}
	}
	require.FailNow(t, "the proxy did not print its ready line")
	return "", nil
}

// chatTurn sends one streaming chat turn and returns the reply text and
// the X-Bidikv-Reuse header.
func chatTurn(t *testing.T, url string, msgs []map[string]string, header http.Header) (string, string) {
	t.Helper()
	body, err := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "messages": msgs, "stream": true, "max_tokens": 8})
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(body))
	require.NoError(t, err)
	for k, v := range header {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	require.Equal(t, http.StatusOK, resp.StatusCode)
	var text strings.Builder
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var ev struct {
			Choices []struct{ Delta struct{ Content string } }
		}
		require.NoError(t, json.Unmarshal([]byte(data), &ev))
		if len(ev.Choices) > 0 {
			text.WriteString(ev.Choices[0].Delta.Content)
		}
	}
	require.NoError(t, sc.Err())
	return text.String(), resp.Header.Get("X-Bidikv-Reuse")
}

// TestOTLPExport runs the proxy with OTEL_EXPORTER_OTLP_ENDPOINT set to a
// collector stand-in, sends a miss and a hit turn (the second with the
// client's traceparent), stops the proxy and checks what arrived: every
// span, flushed by the drain, under service.name bidikv-proxy; each turn's
// phase spans under their parents; and the trace context each engine
// request carried is the exported trace's, with the phase span as parent.
func TestOTLPExport(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true))
	col := newCollector(t)
	env := map[string]string{envOTLPEndpoint: col.url}
	url, stop := runProxy(t, func(k string) string { return env[k] },
		"--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL())

	msgs := []map[string]string{{"role": "user", "content": longQuestion}}
	reply, reuse := chatTurn(t, url, msgs, nil)
	require.Equal(t, "miss", reuse)
	msgs = append(msgs, map[string]string{"role": "assistant", "content": reply}, map[string]string{"role": "user", "content": "What did the fox do next?"})
	const clientTrace, clientSpan = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
	_, reuse = chatTurn(t, url, msgs, http.Header{"Traceparent": {"00-" + clientTrace + "-" + clientSpan + "-01"}})
	require.Equal(t, "hit", reuse)
	require.NoError(t, stop())

	col.mu.Lock()
	defer col.mu.Unlock()
	require.Empty(t, col.bad)
	require.Positive(t, col.requests)
	spans := map[string]*tracepb.Span{} // by span id
	var turns []*tracepb.Span
	for _, e := range col.spans {
		assert.Equal(t, defaultServiceName, e.service)
		spans[hex.EncodeToString(e.span.SpanId)] = e.span
		if e.span.Name == "bidikv.turn" {
			turns = append(turns, e.span)
		}
	}
	require.Len(t, turns, 2)
	sort.Slice(turns, func(i, j int) bool { return turns[i].StartTimeUnixNano < turns[j].StartTimeUnixNano })
	assert.Empty(t, turns[0].ParentSpanId, "turn 1: no inbound trace, a root span")
	assert.Equal(t, clientTrace, hex.EncodeToString(turns[1].TraceId), "turn 2 joins the client's trace")
	assert.Equal(t, clientSpan, hex.EncodeToString(turns[1].ParentSpanId))
	assert.Equal(t, "miss", attrString(turns[0].Attributes, "bidikv.reuse"))
	assert.Equal(t, "hit", attrString(turns[1].Attributes, "bidikv.reuse"))

	want := [][]string{
		{"bidikv.turn", "  bidikv.lookup", "  bidikv.prefill", "  bidikv.decode", "    bidikv.stream"},
		{"bidikv.turn", "  bidikv.lookup", "    bidikv.verify", "  bidikv.prefill", "  bidikv.decode", "    bidikv.stream"},
	}
	for i, turn := range turns {
		assert.Equal(t, want[i], treeNames(spans, turn), "turn %d", i+1)
		t.Logf("turn %d as exported:\n%s", i+1, traceText(spans, turn))
	}

	// Every engine request carried the exported trace, its parent the
	// span of the phase that sent it.
	phase := map[string]string{"prefill": "bidikv.prefill", "decode": "bidikv.decode", "render": "bidikv.verify"}
	var n int
	for _, e := range []*kvroutetest.Engine{cl.Prefill[0], cl.Decode[0]} {
		for _, rr := range e.Requests() {
			if rr.Header.Get("User-Agent") == capability.UserAgent {
				continue // the capability probe's, not a turn's
			}
			parts := strings.Split(rr.Header.Get("Traceparent"), "-")
			require.Len(t, parts, 4, "%s: %q", rr.Role, rr.Header.Get("Traceparent"))
			s, ok := spans[parts[2]]
			require.True(t, ok, "%s: parent span %s was exported", rr.Role, parts[2])
			assert.Equal(t, hex.EncodeToString(s.TraceId), parts[1], rr.Role)
			assert.Equal(t, phase[rr.Role], s.Name, rr.Role)
			n++
		}
	}
	assert.Equal(t, 5, n, "two prefill and two decode legs, one render call")
}

// longQuestion is the README's first turn: long enough to be worth a pull.
const longQuestion = "You are a careful storyteller. Tell me a long story about a red fox who lives at the edge of a quiet pine forest, who every morning walks down to the river to watch the boats, and who one day finds a small wooden boat tied to the bank with nobody in it. Describe the forest, the river, the boats and the fox in detail, and end the story with what the fox decides to do with the boat."

// children returns the spans whose parent is id, in start order.
func children(spans map[string]*tracepb.Span, id []byte) []*tracepb.Span {
	var out []*tracepb.Span
	for _, s := range spans {
		if bytes.Equal(s.ParentSpanId, id) {
			out = append(out, s)
		}
	}
	slices.SortFunc(out, func(a, b *tracepb.Span) int { return int(int64(a.StartTimeUnixNano) - int64(b.StartTimeUnixNano)) })
	return out
}

// treeNames lists root's tree, one indented name per span.
func treeNames(spans map[string]*tracepb.Span, root *tracepb.Span) []string {
	var out []string
	var walk func(s *tracepb.Span, depth int)
	walk = func(s *tracepb.Span, depth int) {
		out = append(out, strings.Repeat("  ", depth)+s.Name)
		for _, c := range children(spans, s.SpanId) {
			walk(c, depth+1)
		}
	}
	walk(root, 0)
	return out
}

// traceText renders root's tree as text: per span its ids, kind, offset
// and duration from the turn's start, status and attributes.
func traceText(spans map[string]*tracepb.Span, root *tracepb.Span) string {
	var b strings.Builder
	fmt.Fprintf(&b, "trace %s\n", hex.EncodeToString(root.TraceId))
	var walk func(s *tracepb.Span, depth int)
	walk = func(s *tracepb.Span, depth int) {
		pad := strings.Repeat("  ", depth)
		start := time.Duration(s.StartTimeUnixNano - root.StartTimeUnixNano)
		dur := time.Duration(s.EndTimeUnixNano - s.StartTimeUnixNano)
		fmt.Fprintf(&b, "%s%s  span %s parent %s  %s  +%v %v",
			pad, s.Name, hex.EncodeToString(s.SpanId), hex.EncodeToString(s.ParentSpanId),
			strings.TrimPrefix(s.Kind.String(), "SPAN_KIND_"), start.Round(time.Microsecond), dur.Round(time.Microsecond))
		if s.Status != nil && s.Status.Code != tracepb.Status_STATUS_CODE_UNSET {
			fmt.Fprintf(&b, "  status %s", strings.TrimPrefix(s.Status.Code.String(), "STATUS_CODE_"))
		}
		b.WriteString("\n")
		for _, kv := range s.Attributes {
			fmt.Fprintf(&b, "%s    %s=%s\n", pad, kv.Key, attrText(kv.Value))
		}
		for _, c := range children(spans, s.SpanId) {
			walk(c, depth+1)
		}
	}
	walk(root, 0)
	return b.String()
}

// TestTelemetryConfig checks which environments turn tracing on.
func TestTelemetryConfig(t *testing.T) {
	for _, tc := range []struct {
		env  map[string]string
		on   bool
		fail bool
	}{
		{env: nil},
		{env: map[string]string{envOTLPEndpoint: "http://127.0.0.1:4318"}, on: true},
		{env: map[string]string{envOTLPTracesEndpoint: "http://127.0.0.1:4318/v1/traces"}, on: true},
		{env: map[string]string{envOTLPEndpoint: "http://127.0.0.1:4318", envTracesExporter: "none"}},
		{env: map[string]string{envOTLPEndpoint: "http://127.0.0.1:4318", envSDKDisabled: "true"}},
		{env: map[string]string{envTracesExporter: "console"}, on: true},
		{env: map[string]string{envTracesExporter: "zipkin"}, fail: true},
	} {
		tel, err := newTelemetry(func(k string) string { return tc.env[k] }, io.Discard, discardLogger())
		if tc.fail {
			require.ErrorIs(t, err, errUsage, "%v", tc.env)
			continue
		}
		require.NoError(t, err, "%v", tc.env)
		assert.Equal(t, tc.on, tel != nil, "%v", tc.env)
		assert.Len(t, tel.options(), map[bool]int{true: 1}[tc.on])
		tel.shutdown(discardLogger())
	}
	assert.Equal(t, "http://c:4318/v1/traces", otlpTracesURL(func(k string) string { return map[string]string{envOTLPEndpoint: "http://c:4318/"}[k] }))
	assert.Equal(t, "http://c:4318/custom", otlpTracesURL(func(k string) string {
		return map[string]string{envOTLPEndpoint: "http://x", envOTLPTracesEndpoint: "http://c:4318/custom"}[k]
	}))
}

func discardLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }
