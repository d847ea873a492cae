package transport_test

import (
	"bytes"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport"
)

// TestBuffersBody sends bodies of pieces, small and larger than net/http's
// write buffer, through NewTransport: the engine reads exactly their
// concatenation.
func TestBuffersBody(t *testing.T) {
	got := make(chan []byte, 1)
	srv := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		b, _ := io.ReadAll(r.Body)
		got <- b
	}))
	defer srv.Close()
	rt, err := transport.NewTransport()
	require.NoError(t, err)
	defer rt.CloseIdleConnections()
	for _, n := range []int{0, 10, 5000, 100 << 10} {
		pieces := [][]byte{[]byte(`{"a":`), []byte(strings.Repeat("7", n) + "1"), []byte(`,"b":`), {}, []byte(`"x"}`)}
		want := bytes.Join(pieces, nil)
		closed := 0
		body := transport.NewBuffers(pieces, func() { closed++ })
		assert.Equal(t, len(want), body.Len())
		req, err := http.NewRequest(http.MethodPost, srv.URL, body)
		require.NoError(t, err)
		req.ContentLength = int64(len(want))
		resp, err := rt.RoundTrip(req)
		require.NoError(t, err)
		_ = resp.Body.Close()
		assert.Equal(t, string(want), string(<-got), "body of %d bytes", len(want))
		assert.Equal(t, 0, body.Len(), "consumed")
		assert.Equal(t, 1, closed, "net/http closed the body once")
	}
}

// TestBuffersRead reads a body of pieces in small steps.
func TestBuffersRead(t *testing.T) {
	closed := 0
	b := transport.NewBuffers([][]byte{[]byte("ab"), nil, []byte("cde")}, func() { closed++ })
	var out bytes.Buffer
	buf := make([]byte, 2)
	for {
		n, err := b.Read(buf)
		out.Write(buf[:n])
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
	}
	assert.Equal(t, "abcde", out.String())
	assert.Equal(t, 0, b.Len())
	assert.NoError(t, b.Close())
	assert.NoError(t, b.Close())
	assert.Equal(t, 1, closed, "onClose runs once")
}
