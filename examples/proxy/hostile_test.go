package main

import (
	"net/http"
	"testing"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Issue 21, items 3 to 6 and 20, end to end: through the proxy, a decode
// engine that hides its handle in every malformed way, on every API,
// streaming or not, gets nothing of it to the client.
func TestHostileDecodeEngineThroughProxy(t *testing.T) {
	e := kvroutetest.NewHostileEngine(t, kvroutetest.HostileAnswer{})
	p := startInProcess(t, nil, "--prefill", e.URL(), "--decode", e.URL())
	client := &http.Client{Transport: &http.Transport{DisableCompression: true}}
	t.Cleanup(client.CloseIdleConnections)
	kvroutetest.TestHostile(t, e, p.url, client)
}
