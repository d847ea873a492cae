package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// lateEOF holds back any read of a request body after it returned EOF (the
// read the Transport makes after Content-Length bytes, to see the end of a
// body it forwards) until the dispatcher has flushed the answer's header.
type lateEOF struct {
	io.ReadCloser
	flushed <-chan struct{}
	eof     bool
}

func (b *lateEOF) Read(p []byte) (int, error) {
	if b.eof {
		select {
		case <-b.flushed:
		case <-time.After(5 * time.Second): // not forwarded: bounded
		}
	}
	n, err := b.ReadCloser.Read(p)
	b.eof = b.eof || err == io.EOF
	return n, err
}

// flushSignal closes flushed after the first Flush of its ResponseWriter.
type flushSignal struct {
	http.ResponseWriter
	once    sync.Once
	flushed chan struct{}
}

func (w *flushSignal) Flush() {
	_ = http.NewResponseController(w.ResponseWriter).Flush()
	w.once.Do(func() { close(w.flushed) })
}

func (w *flushSignal) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// TestSoakDispatcherLateEOF is, made certain, the race that cut the soak's
// streams in its dispatchers (see reverseProxy): the Transport's read after
// the last byte of the request body comes only after the dispatcher has
// flushed the engine's answer header. The streaming turn that stops on its
// first token must still reach [DONE] through the dispatcher.
func TestSoakDispatcherLateEOF(t *testing.T) {
	eng := kvroutetest.NewEngine(t, kvroutetest.WithStreamHandles(true), // as the soak's decode engine
		kvroutetest.WithProfile(kvroutetest.Profile{Name: "soak", InterTokenLatency: soakITL}), kvroutetest.WithSpeed(1))
	tr := &http.Transport{}
	defer tr.CloseIdleConnections()
	route := reverseProxy(t, eng.URL(), tr)
	disp := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fw := &flushSignal{ResponseWriter: w, flushed: make(chan struct{})}
		r.Body = &lateEOF{ReadCloser: r.Body, flushed: fw.flushed}
		route.ServeHTTP(fw, r)
	}))
	defer disp.Close()
	client := &http.Client{Transport: &http.Transport{}}
	defer client.CloseIdleConnections()

	for i := range 3 {
		msgs := []map[string]string{{"role": "user", "content": fmt.Sprintf("dispatch %d: say one word about the river and stop", i)}}
		probe, err := json.Marshal(map[string]any{"model": "sim-model", "messages": msgs, "max_tokens": 1})
		require.NoError(t, err)
		first, err := kvroutetest.Reference("/v1/chat/completions", probe)
		require.NoError(t, err)
		body, err := json.Marshal(map[string]any{"model": "sim-model", "messages": msgs, "max_tokens": 12, "stop": []string{first.Text}, "stream": true})
		require.NoError(t, err)
		resp, err := client.Post(disp.URL+"/v1/chat/completions", "application/json", bytes.NewReader(body))
		require.NoError(t, err)
		raw, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		require.NoError(t, err, "turn %d: the stream was cut after %d bytes: %s", i, len(raw), clip(raw))
		assert.Equal(t, http.StatusOK, resp.StatusCode)
		assert.True(t, bytes.HasSuffix(raw, []byte("data: [DONE]\n\n")), "turn %d: %s", i, clip(raw))
		assert.Contains(t, string(raw), `"finish_reason":"stop"`, "turn %d", i)
	}
}
