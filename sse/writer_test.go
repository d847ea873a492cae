package sse_test

import (
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/sse"
)

// wrapped is a ResponseWriter wrapper that hides Flush but implements
// Unwrap, as middleware does.
type wrapped struct{ http.ResponseWriter }

func (w wrapped) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// noFlusher cannot flush.
type noFlusher struct {
	h http.Header
	strings.Builder
}

func (n *noFlusher) Header() http.Header { return n.h }
func (*noFlusher) WriteHeader(int)       {}

func TestWriterFlushesEachWrite(t *testing.T) {
	rec := httptest.NewRecorder()
	w := sse.NewWriter(wrapped{rec})

	require.NoError(t, w.WriteRaw([]byte(": ping\n\n")))
	assert.True(t, rec.Flushed, "flushed through Unwrap")
	rec.Flushed = false

	require.NoError(t, w.WriteRaw([]byte("data: {\"a\":1}\n\n")))
	assert.True(t, rec.Flushed)
	rec.Flushed = false

	require.NoError(t, w.WriteRaw([]byte("data: [DONE]\n\n")))
	assert.True(t, rec.Flushed)
	assert.Equal(t, ": ping\n\ndata: {\"a\":1}\n\ndata: [DONE]\n\n", rec.Body.String())
}

func TestWriterWithoutFlusher(t *testing.T) {
	nf := &noFlusher{h: http.Header{}}
	w := sse.NewWriter(nf)
	require.NoError(t, w.WriteRaw([]byte("data: x\n\n")))
	require.NoError(t, w.WriteRaw([]byte("data: y\n\n")))
	assert.Equal(t, "data: x\n\ndata: y\n\n", nf.String())
}

func TestWriterWriteError(t *testing.T) {
	w := sse.NewWriter(failing{})
	assert.ErrorIs(t, w.WriteRaw([]byte("data: x\n\n")), errClosed)
}

var errClosed = errors.New("closed")

type failing struct{ http.ResponseWriter }

func (failing) Write([]byte) (int, error) { return 0, errClosed }

func TestWriterOverHTTP(t *testing.T) {
	events := make(chan string)
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "text/event-stream")
		w := sse.NewWriter(rw)
		if err := w.Flush(); err != nil { // send the headers
			return
		}
		for e := range events {
			if err := w.WriteRaw([]byte("data: " + e + "\n\n")); err != nil {
				return
			}
		}
		_ = w.WriteRaw([]byte("data: [DONE]\n\n"))
	}))
	defer srv.Close()

	resp, err := http.Get(srv.URL)
	require.NoError(t, err)
	defer resp.Body.Close()
	r := sse.NewReader(resp.Body)
	for _, want := range []string{"one", "two"} {
		events <- want
		// Each event arrives before the handler writes the next one: this
		// would block forever without a flush per write.
		e, err := r.Next()
		require.NoError(t, err)
		assert.Equal(t, want, string(e.Data))
	}
	close(events)
	e, err := r.Next()
	require.NoError(t, err)
	assert.Equal(t, "[DONE]", string(e.Data))
	_, err = r.Next()
	assert.ErrorIs(t, err, io.EOF)
}
