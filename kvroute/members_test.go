package kvroute_test

import (
	"fmt"
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// An object with more members than WithMaxObjectMembers, anywhere in a
// request body, gets 400 before the router indexes it; at the limit the
// turn is served with the single engine's answer. On every API.
func TestMaxObjectMembers(t *testing.T) {
	const limit = 40
	c := kvroutetest.NewCluster(t, 1, 1)
	url := serve(t, newRouter(t, c, kvroute.WithLimits(kvroute.Limits{ObjectMembers: limit})))
	members := func(n int) string {
		var b strings.Builder
		for i := range n {
			fmt.Fprintf(&b, `,"x%d":%d`, i, i)
		}
		return b.String()
	}
	dups := strings.Repeat(`,"n":1`, limit+1)
	for _, tc := range []struct {
		name, path, body string
		refused          bool
	}{
		{"top level at the limit", kvroute.PathChatCompletions,
			`{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4` + members(limit-3) + `}`, false},
		{"top level above", kvroute.PathChatCompletions,
			`{"model":"sim-model","messages":[{"role":"user","content":"hi"}],"max_tokens":4` + members(limit-2) + `}`, true},
		{"duplicate keys", kvroute.PathChatCompletions,
			`{"model":"sim-model","messages":[{"role":"user","content":"hi"}]` + dups + `}`, true},
		{"in a message", kvroute.PathChatCompletions,
			`{"model":"sim-model","messages":[{"role":"user","content":"hi"` + members(limit) + `}]}`, true},
		{"in a tool call", kvroute.PathChatCompletions,
			`{"model":"sim-model","messages":[{"role":"user","content":"hi"},{"role":"assistant","content":"","tool_calls":[{"id":"c","type":"function","function":{"name":"f","arguments":"{}"}` + members(limit) + `}]},{"role":"tool","tool_call_id":"c","content":"ok"}]}`, true},
		{"in logit_bias", kvroute.PathCompletions,
			`{"model":"sim-model","prompt":"hi","logit_bias":{"0":1` + members(limit) + `}}`, true},
		{"in a responses input item", kvroute.PathResponses,
			`{"model":"sim-model","input":[{"role":"user","content":"hi"` + members(limit) + `}]}`, true},
		{"in messages metadata", kvroute.PathMessages,
			`{"model":"sim-model","max_tokens":4,"messages":[{"role":"user","content":"hi"}],"metadata":{"a":1` + members(limit) + `}}`, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			res := send(t, url, tc.path, []byte(tc.body), nil)
			if !tc.refused {
				require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
				return
			}
			assert.Equal(t, http.StatusBadRequest, res.status, "%s", res.raw)
			assert.Contains(t, string(res.raw), fmt.Sprintf("more than %d members", limit))
		})
	}
}
