package kvroutetest

import (
	"bytes"
	"net/http"
	"slices"
	"strings"
	"testing"

	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
)

// TestHostileBuffered is TestHostile for buffered streams (kvroute's
// DecodeMemory.BufferStreams): the router (or proxy) at url must buffer
// the streams of PathChat, PathCompletions and PathMessages, and e is its
// only engine. Each API's streamed request gets each non-streaming
// HostileAnswer of the API, the decode leg of a buffered stream being
// non-streaming. Before the answers of chat and completions, one clean
// stream without a handle shows the router that e's streams of the API
// carry none. For each answer it checks that:
//
//   - CheckLeak finds nothing of the handle in what the client received;
//   - an answer whose handle is removable reaches the client with 200 as
//     exactly the stream the API defines for Clean (streamsynth), read
//     strictly and leniently;
//   - a 2xx answer is decoded once.
func TestHostileBuffered(t *testing.T, e *HostileEngine, url string, client *http.Client) {
	for _, path := range []string{PathChat, PathCompletions, PathMessages} {
		t.Run(path, func(t *testing.T) {
			if path != PathMessages {
				teach := HostileAnswers(path, true)[0]
				if teach.Clean == nil {
					t.Fatalf("no clean stream of %s to show the engine's streams", path)
				}
				teach.Body, teach.Name = teach.Clean, "a clean stream"
				hostileTurn(t, e, url, client, teach)
			}
			a, _ := streamsynth.ForPath(path)
			for _, h := range HostileAnswers(path, false) {
				t.Run(h.Name, func(t *testing.T) { bufferedTurn(t, e, url, client, a, h) })
			}
		})
	}
}

func bufferedTurn(t *testing.T, e *HostileEngine, url string, client *http.Client, api streamsynth.API, a HostileAnswer) {
	t.Helper()
	resp, body := sendHostile(t, e, url, client, a, true)
	if a.Clean == nil {
		return
	}
	var want bytes.Buffer
	if err := api.Write(&want, a.Clean, streamsynth.Options{}); err != nil {
		// Not an answer of the API: the router fails the turn before
		// its headers.
		if resp.StatusCode != http.StatusBadGateway {
			t.Errorf("status %d for an answer that is not one of the API (%v), want 502: %.600q", resp.StatusCode, err, body)
		}
		return
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d for a removable handle: %.600q", resp.StatusCode, body)
	}
	if ct := resp.Header.Get("Content-Type"); !strings.HasPrefix(ct, "text/event-stream") {
		t.Errorf("Content-Type %q, want a stream's", ct)
	}
	for _, lenient := range []bool{false, true} {
		if got, want := ParseEvents(body, lenient), ParseEvents(want.Bytes(), lenient); !slices.EqualFunc(got, want, eventEqual) {
			t.Errorf("lenient %v: forwarded events %q\nwant %q", lenient, got, want)
		}
	}
}
