package peertier_test

import (
	"encoding/json"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/peertier"
	"github.com/bidikv/bidikv/retention/budget"
)

func TestAddr(t *testing.T) {
	c := peertier.Config{Tokens: 1, Peers: map[string]string{"http://d1:8000": "10.0.0.7:7777", "http://bad": "nohostport"}}
	h, p, ok := c.Addr("http://d0:8000")
	assert.True(t, ok)
	assert.Equal(t, "d0", h)
	assert.Equal(t, peertier.DefaultPort, p)
	h, p, ok = c.Addr("http://d1:8000")
	assert.True(t, ok)
	assert.Equal(t, "10.0.0.7", h)
	assert.Equal(t, 7777, p)
	_, _, ok = c.Addr("http://bad")
	assert.False(t, ok)
	_, _, ok = c.Addr("::not a url")
	assert.False(t, ok)
	c.Port = 6000
	_, p, _ = c.Addr("http://[::1]:8000")
	assert.Equal(t, 6000, p)
}

func TestResident(t *testing.T) {
	p := budget.Placement{Decode: "d", Tokens: 10000}
	assert.Equal(t, 10000, peertier.Resident(50000, p, 0, 16))
	assert.Equal(t, 10000, peertier.Resident(50000, p, 40000, 16), "exactly fits")
	assert.Equal(t, 4992, peertier.Resident(50000, p, 45000, 16), "the head survives, in whole blocks")
	assert.Zero(t, peertier.Resident(50000, p, 50000, 16))
	assert.Zero(t, peertier.Resident(0, p, 0, 16), "no tier")
	assert.Zero(t, peertier.Resident(50000, budget.Placement{Tokens: 100}, 0, 16), "no decode engine")
}

func TestHeld(t *testing.T) {
	assert.Equal(t, 1008, peertier.Config{}.Held(900, 1020, 16))
	assert.Equal(t, 896, peertier.Config{PromptOnly: true}.Held(900, 1020, 16))
	assert.Equal(t, 1008, peertier.Config{PromptOnly: true}.Held(0, 1020, 16), "prompt unknown")
}

func TestWithSource(t *testing.T) {
	for _, in := range []string{`{"do_remote_decode":true}`, `{}`, ` { } `, `{"a":1} `} {
		out := peertier.WithSource(nil, []byte(in), "kv-1\"x", "10.0.0.1", 5710)
		var m map[string]any
		require.NoError(t, json.Unmarshal(out, &m), "%s -> %s", in, out)
		src, _ := m["remote_kv_source"].(map[string]any)
		assert.Equal(t, map[string]any{"kv_request_id": "kv-1\"x", "remote_host": "10.0.0.1", "remote_port": 5710.0}, src)
	}
	assert.Equal(t, "null", string(peertier.WithSource(nil, []byte("null"), "a", "h", 1)))
}
