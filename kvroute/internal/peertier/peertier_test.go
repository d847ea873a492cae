package peertier_test

import (
	"encoding/json"
	"net/url"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/internal/peertier"
)

func TestAddr(t *testing.T) {
	c := peertier.Config{Tokens: 1, Peers: map[string]string{"http://d1:8000": "10.0.0.7:7777",
		"http://d2:8000 (rank 1)": "10.0.0.8:6000", "http://bad": "nohostport"}}
	u := func(s string) *url.URL {
		v, err := url.Parse(s)
		require.NoError(t, err)
		return v
	}
	for _, tc := range []struct {
		id, base string
		rank     int
		host     string
		port     int
		ok       bool
	}{
		{"http://d0:8000", "http://d0:8000", -1, "d0", peertier.DefaultPort, true},
		{"http://d0:8000 (rank 2)", "http://d0:8000", 2, "d0", peertier.DefaultPort + 2, true},
		{"http://d1:8000", "http://d1:8000", -1, "10.0.0.7", 7777, true},
		{"http://d1:8000 (rank 3)", "http://d1:8000", 3, "10.0.0.7", 7780, true}, // the base's entry, plus the rank
		{"http://d2:8000 (rank 1)", "http://d2:8000", 1, "10.0.0.8", 6000, true}, // the rank's own entry
		{"http://bad", "http://bad", -1, "", 0, false},
		{"x", "", -1, "", 0, false},
	} {
		var base *url.URL
		if tc.base != "" {
			base = u(tc.base)
		}
		h, p, ok := c.Addr(tc.id, base, tc.rank)
		assert.Equal(t, tc.ok, ok, tc.id)
		assert.Equal(t, tc.host, h, tc.id)
		assert.Equal(t, tc.port, p, tc.id)
	}
	c.Port = 6000
	_, p, _ := c.Addr("http://[::1]:8000", u("http://[::1]:8000"), -1)
	assert.Equal(t, 6000, p)
	assert.True(t, peertier.ValidPeer("h:1"))
	assert.False(t, peertier.ValidPeer("h"))
	assert.False(t, peertier.ValidPeer("h:0"))
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

// Loadable is the estimate as vLLM can load it: whole blocks short of the
// prompt's last token.
func TestLoadable(t *testing.T) {
	for _, tc := range []struct{ resident, prompt, bs, want int }{
		{3616, 3616, 16, 3600}, // the whole prompt resident: its last block stays to compute
		{3616, 3617, 16, 3616},
		{3616, 0, 16, 3616}, // prompt unknown
		{3584, 9000, 64, 3584},
		{3648, 3648, 64, 3584},
		{100, 1, 16, 0},
		{48, 40, 0, 39}, // block size unknown: tokens
	} {
		assert.Equal(t, tc.want, peertier.Loadable(tc.resident, tc.prompt, tc.bs), "%+v", tc)
	}
}
