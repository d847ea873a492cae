package kvroute_test

import (
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Issue 21, items 3 to 6 and 20: a decode engine that hides its handle in
// every malformed way, on every API, streaming or not: nothing of the
// handle reaches the client, a removable handle is removed with every
// other byte kept, and a deterministic failure is not redone.
func TestHostileDecodeEngine(t *testing.T) {
	e := kvroutetest.NewHostileEngine(t, kvroutetest.HostileAnswer{})
	url, client := hostileRouter(t, e)
	kvroutetest.TestHostile(t, e, url, client)
}

// Issue 24, item 3: buffered streams pass the same suite: a non-streaming
// decode answer is scrubbed before it is written as the API's stream.
func TestHostileBufferedStreams(t *testing.T) {
	e := kvroutetest.NewHostileEngine(t, kvroutetest.HostileAnswer{})
	url, client := hostileRouter(t, e,
		kvroute.WithDecodeMemory(kvroute.DecodeMemory{BufferStreams: []string{kvroute.PathChatCompletions, kvroute.PathCompletions, kvroute.PathMessages}}))
	kvroutetest.TestHostileBuffered(t, e, url, client)
}

// hostileRouter serves a router whose prefill and decode engine is e
// (opts added) and returns its URL and a client that asks for no
// compression (the suites check what the router sends as it is).
func hostileRouter(t *testing.T, e *kvroutetest.HostileEngine, opts ...kvroute.Option) (string, *http.Client) {
	t.Helper()
	r, err := kvroute.New(append([]kvroute.Option{kvroute.WithPrefill(e.URL()), kvroute.WithDecode(e.URL()),
		kvroute.WithLogger(slog.New(slog.DiscardHandler))}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = r.Close() })
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close)
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	t.Cleanup(client.CloseIdleConnections)
	return srv.URL, client
}
