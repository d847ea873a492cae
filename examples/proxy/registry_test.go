package main

import (
	"encoding/json"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
)

// The proxy's route table and its error shapes follow kvroute's registry
// (kvroute.APIs), not a list of its own: every API the router serves is
// routed to it (a malformed body gets the router's 400, not the proxy's
// 404), and what the proxy answers there itself (a wrong method) takes the
// API's error shape.
func TestRoutesFollowTheRegistry(t *testing.T) {
	apis := kvroute.APIs()
	require.NotEmpty(t, apis)
	p := startInProcess(t, nil)
	for _, a := range apis {
		t.Run(a.Path, func(t *testing.T) {
			status, _, body := p.do(t, http.MethodPost, a.Path, `[]`)
			assert.Equal(t, http.StatusBadRequest, status, "routed to the router: %s", body)
			assertShape(t, a.ErrorShape, body)

			status, h, body := p.do(t, http.MethodGet, a.Path, "")
			assert.Equal(t, http.StatusMethodNotAllowed, status, body)
			assert.Equal(t, http.MethodPost, h.Get("Allow"))
			assertShape(t, a.ErrorShape, body)
		})
	}
}

// assertShape checks that body is an error in the named shape.
func assertShape(t *testing.T, shape, body string) {
	t.Helper()
	var e map[string]json.RawMessage
	require.NoError(t, json.Unmarshal([]byte(body), &e), body)
	switch shape {
	case "anthropic":
		assert.JSONEq(t, `"error"`, string(e["type"]), body)
	case "openai":
		assert.NotContains(t, e, "type", body)
	default:
		t.Fatalf("unknown shape %q", shape)
	}
	assert.Contains(t, e, "error", body)
}
