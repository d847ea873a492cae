package main

import (
	"bytes"
	"io"
	"net/http"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// releaseUserAgent is the User-Agent of the router's release requests
// (kvroute's releaser.go).
const releaseUserAgent = "bidikv-release"

// clockTransport makes the router's release requests participants of
// the event clock while they are in flight: they run in the background,
// outside any session, yet block in a prefill engine on the clock like a
// session's request. Counted, they keep the clock from moving while one
// is about to block; uncounted, the clock would take their blocking for a
// session's. The response is read whole before the request leaves, so
// that the engine has finished with it.
type clockTransport struct {
	base http.RoundTripper
	clk  *kvroutetest.EventClock
}

// RoundTrip implements http.RoundTripper.
func (t clockTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if req.Header.Get("User-Agent") != releaseUserAgent {
		return t.base.RoundTrip(req)
	}
	t.clk.Join()
	defer t.clk.Leave()
	resp, err := t.base.RoundTrip(req)
	if err != nil {
		return nil, err
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		return nil, err
	}
	resp.Body = io.NopCloser(bytes.NewReader(body))
	return resp, nil
}
