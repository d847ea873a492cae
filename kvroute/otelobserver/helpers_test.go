package otelobserver_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"go.opentelemetry.io/otel/propagation"
	sdkmetric "go.opentelemetry.io/otel/sdk/metric"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
	"github.com/bidikv/bidikv/kvroute/otelobserver"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// systemPrompt makes a conversation long enough for the default reuse
// threshold.
const systemPrompt = "You are a coding agent working in a large Go repository. You can list files, read them, run the tests and edit code. " +
	"Think about the failing tests before you change anything, keep changes small, explain each step in one sentence, " +
	"and never invent file names: list the directory first. When the tests pass, summarise what you changed and why."

// rig is a 1P1D cluster behind a router traced by an Observer whose spans
// go to an in-memory exporter and whose metrics to a manual reader.
type rig struct {
	c      *kvroutetest.Cluster
	spans  *tracetest.InMemoryExporter
	reader *sdkmetric.ManualReader
	router *kvroute.Router
	url    string
}

func newRig(t *testing.T, ropts ...kvroute.Option) *rig {
	t.Helper()
	g := &rig{
		c:      kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithStreamHandles(true)),
		spans:  tracetest.NewInMemoryExporter(),
		reader: sdkmetric.NewManualReader(),
	}
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(g.spans))
	mp := sdkmetric.NewMeterProvider(sdkmetric.WithReader(g.reader))
	t.Cleanup(func() {
		_ = tp.Shutdown(context.Background())
		_ = mp.Shutdown(context.Background())
	})
	o, err := otelobserver.New(otelobserver.WithTracerProvider(tp), otelobserver.WithMeterProvider(mp))
	require.NoError(t, err)
	opts := append([]kvroute.Option{kvroute.WithPrefill(g.c.Prefill[0].URL()), kvroute.WithDecode(g.c.Decode[0].URL())}, o.Options()...)
	g.router, err = kvroute.New(append(opts, ropts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = g.router.Close() })
	srv := httptest.NewServer(g.router)
	t.Cleanup(srv.Close)
	g.url = srv.URL
	return g
}

// take returns the spans exported since the last call.
func (g *rig) take() tracetest.SpanStubs {
	s := g.spans.GetSpans()
	g.spans.Reset()
	return s
}

type message struct {
	Role    string `json:"role"`
	Content string `json:"content"`
}

// conversation is a chat client that resends its whole history.
type conversation struct {
	stream   bool
	messages []message
}

func newConversation(stream bool) *conversation {
	return &conversation{stream: stream, messages: []message{{Role: "system", Content: systemPrompt}}}
}

func (c *conversation) body(user string) []byte {
	c.messages = append(c.messages, message{Role: "user", Content: user})
	b, err := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "max_tokens": 8, "stream": c.stream, "messages": c.messages})
	if err != nil {
		panic(err)
	}
	return b
}

// turn posts the next user message with header and records the reply; it
// returns the status and the X-Bidikv-Reuse header.
func (c *conversation) turn(t testing.TB, url, user string, header http.Header) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url+kvroute.PathChatCompletions, bytes.NewReader(c.body(user)))
	require.NoError(t, err)
	for k, v := range header {
		req.Header[k] = v
	}
	req.Header.Set("Content-Type", "application/json")
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	raw, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	if resp.StatusCode == http.StatusOK {
		c.hear(t, raw)
	}
	return resp.StatusCode, resp.Header.Get("X-Bidikv-Reuse")
}

// hear appends the reply of a body or a stream to the history.
func (c *conversation) hear(t testing.TB, raw []byte) {
	t.Helper()
	var text strings.Builder
	type choice struct {
		Message, Delta struct{ Content string }
	}
	if !c.stream {
		var b struct{ Choices []choice }
		require.NoError(t, json.Unmarshal(raw, &b))
		require.NotEmpty(t, b.Choices)
		text.WriteString(b.Choices[0].Message.Content)
	} else {
		sc := bufio.NewScanner(bytes.NewReader(raw))
		sc.Buffer(nil, 1<<20)
		for sc.Scan() {
			data, ok := strings.CutPrefix(sc.Text(), "data: ")
			if !ok || data == "[DONE]" {
				continue
			}
			var ev struct{ Choices []choice }
			require.NoError(t, json.Unmarshal([]byte(data), &ev))
			if len(ev.Choices) > 0 {
				text.WriteString(ev.Choices[0].Delta.Content)
			}
		}
	}
	c.messages = append(c.messages, message{Role: "assistant", Content: text.String()})
}

// engineTrace is the trace context an engine request carried.
func engineTrace(rr kvroutetest.RequestRecord) trace.SpanContext {
	ctx := propagation.TraceContext{}.Extract(context.Background(), propagation.HeaderCarrier(rr.Header))
	return trace.SpanContextFromContext(ctx)
}
