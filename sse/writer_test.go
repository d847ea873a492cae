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

	require.NoError(t, w.WriteData([]byte(`{"a":1}`)))
	assert.True(t, rec.Flushed)
	rec.Flushed = false

	require.NoError(t, w.WriteDone())
	assert.True(t, rec.Flushed)
	assert.Equal(t, ": ping\n\ndata: {\"a\":1}\n\ndata: [DONE]\n\n", rec.Body.String())
}

func TestWriterWithoutFlusher(t *testing.T) {
	nf := &noFlusher{h: http.Header{}}
	w := sse.NewWriter(nf)
	require.NoError(t, w.WriteData([]byte("x")))
	require.NoError(t, w.WriteData([]byte("y")))
	assert.Equal(t, "data: x\n\ndata: y\n\n", nf.String())
}

func TestWriterWriteError(t *testing.T) {
	w := sse.NewWriter(failing{})
	assert.ErrorIs(t, w.WriteRaw([]byte("data: x\n\n")), errClosed)
}

var errClosed = errors.New("closed")

type failing struct{ http.ResponseWriter }

func (failing) Write([]byte) (int, error) { return 0, errClosed }

func TestAppendData(t *testing.T) {
	tests := []struct{ in, want string }{
		{"", "data: \n\n"},
		{"x", "data: x\n\n"},
		{"a\nb", "data: a\ndata: b\n\n"},
		{"a\r\nb\rc\n", "data: a\ndata: b\ndata: c\ndata: \n\n"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			got := sse.AppendData(nil, []byte(tt.in))
			assert.Equal(t, tt.want, string(got))
			e, err := sse.NewReader(strings.NewReader(string(got))).Next()
			require.NoError(t, err)
			want := strings.NewReplacer("\r\n", "\n", "\r", "\n").Replace(tt.in)
			assert.Equal(t, want, string(e.Data), "round trip through Reader")
		})
	}
}

func TestWriterOverHTTP(t *testing.T) {
	events := make(chan string)
	srv := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "text/event-stream")
		w := sse.NewWriter(rw)
		if err := w.Flush(); err != nil { // send the headers
			return
		}
		for e := range events {
			if err := w.WriteData([]byte(e)); err != nil {
				return
			}
		}
		_ = w.WriteDone()
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
