package kvroute_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// hostileRequest is a minimal request of the API at path.
func hostileRequest(path string, stream bool) string {
	switch path {
	case kvroute.PathCompletions:
		return fmt.Sprintf(`{"model":"m","prompt":"hi","max_tokens":8,"stream":%v}`, stream)
	case kvroute.PathResponses:
		return fmt.Sprintf(`{"model":"m","input":"hi","max_output_tokens":8,"stream":%v}`, stream)
	case kvroute.PathMessages:
		return fmt.Sprintf(`{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}],"stream":%v}`, stream)
	}
	return fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":%v}`, stream)
}

var hostilePaths = []string{kvroute.PathChatCompletions, kvroute.PathCompletions, kvroute.PathResponses, kvroute.PathMessages}

// hostileTurn sends one request through url and returns what the client
// received, bytes as sent (no transparent decompression).
func hostileTurn(t *testing.T, client *http.Client, url, path string, stream bool) (int, http.Header, []byte) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+path, bytes.NewReader([]byte(hostileRequest(path, stream))))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept-Encoding", "gzip, br, zstd, deflate")
	resp, err := client.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, b
}

// checkHostile runs every hostile answer for path and stream through the
// client at url (a router, or a proxy in front of one) whose decode
// engine is e: no byte of a handle reaches the client, a removable handle
// is removed with every other byte kept, and no 2xx answer is decoded
// twice (a deterministic failure is not redone).
func checkHostile(t *testing.T, e *kvroutetest.HostileEngine, client *http.Client, url, path string, stream bool) {
	for _, a := range kvroutetest.HostileAnswers(path, stream) {
		t.Run(a.Name, func(t *testing.T) {
			e.SetAnswer(a)
			before := e.DecodeLegs()
			status, h, body := hostileTurn(t, client, url, path, stream)
			require.NoError(t, kvroutetest.CheckLeak(h, body, kvroutetest.HostileSecrets()...), "status %d, answer %.300q\nforwarded %.600q", status, a.Body, body)
			if a.Status/100 == 2 {
				assert.EqualValues(t, 1, e.DecodeLegs()-before, "decode legs")
			}
			if a.Clean == nil {
				return
			}
			require.Equal(t, http.StatusOK, status, "%.600q", body)
			if !stream {
				assert.Equal(t, string(a.Clean), string(body))
				return
			}
			assert.Equal(t, kvroutetest.ParseEvents(a.Clean, false), kvroutetest.ParseEvents(body, false), "forwarded %q", body)
			assert.Equal(t, kvroutetest.ParseEvents(a.Clean, true), kvroutetest.ParseEvents(body, true), "forwarded (lenient) %q", body)
		})
	}
}

// Issue 21, items 3 to 6 and 20: a decode engine that hides its handle in
// every malformed way, on every API, streaming or not.
func TestHostileDecodeEngine(t *testing.T) {
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	t.Cleanup(client.CloseIdleConnections)
	for _, path := range hostilePaths {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s stream=%v", path, stream), func(t *testing.T) {
				e := kvroutetest.NewHostileEngine(t, kvroutetest.HostileAnswer{})
				r, err := kvroute.New(kvroute.WithPrefill(e.URL()), kvroute.WithDecode(e.URL()),
					kvroute.WithLogger(slog.New(slog.DiscardHandler)))
				require.NoError(t, err)
				t.Cleanup(func() { _ = r.Close() })
				srv := httptest.NewServer(r)
				t.Cleanup(srv.Close)
				checkHostile(t, e, client, srv.URL, path, stream)
			})
		}
	}
}
