package transport_test

import (
	"context"
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport"
)

func TestParseEndpoint(t *testing.T) {
	tests := []struct {
		in   string
		want string
	}{
		{"http://localhost:8000", "http://localhost:8000"},
		{"localhost:8000", "http://localhost:8000"},
		{"127.0.0.1:8100", "http://127.0.0.1:8100"},
		{"  http://10.0.0.5:8000  ", "http://10.0.0.5:8000"},
		{"https://engine.internal", "https://engine.internal"},
		{"HTTP://Engine-A:8000", "http://Engine-A:8000"},
		{"[::1]:8100", "http://[::1]:8100"},
		{"http://[::1]:8100", "http://[::1]:8100"},
		{"http://[::1]", "http://[::1]"},
		{"https://[2001:db8::7]:443/prefix/", "https://[2001:db8::7]:443/prefix"},
		{"http://[fe80::1%25eth0]:8100", "http://[fe80::1%25eth0]:8100"},
		{"http://engine:8000/team-a/vllm//", "http://engine:8000/team-a/vllm"},
		{"engine:8000/", "http://engine:8000"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			e, err := transport.ParseEndpoint(tt.in)
			require.NoError(t, err)
			assert.Equal(t, tt.want, e.URL.String())
			assert.Equal(t, transport.NoRank, e.Rank)
			assert.Equal(t, 1, e.Weight)
		})
	}
}

func TestParseEndpointRejects(t *testing.T) {
	tests := []struct {
		in     string
		reason string
	}{
		{"", "empty"},
		{"   ", "empty"},
		{"ftp://h:21", "scheme"},
		{"unix:///tmp/sock", "scheme"},
		{"::1", "brackets"},
		{"::1:8100", "brackets"},
		{"http://::1:8100", "brackets"},
		{"http://[foo]:8100", "invalid host"},
		{"http://:8000", "missing host"},
		{":8000", "missing host"},
		{"8000", "numeric-only host"},
		{"http://h:0", "port"},
		{"http://h:65536", "port"},
		{"http://h:", "empty port"},
		{"http://h:http", "invalid port"},
		{"http://user:hunter2@h:1", "user info"},
		{"http://h:1/v1?x=1", "query"},
		{"http://h:1/?", "query"},
		{"http://h:1#frag", "fragment"},
		{"http://h h:1", "invalid character"},
		{"[::%25\x82]:8100", "invalid IPv6 zone"},
	}
	for _, tt := range tests {
		t.Run(tt.in, func(t *testing.T) {
			_, err := transport.ParseEndpoint(tt.in)
			require.ErrorIs(t, err, transport.ErrInvalidEndpoint)
			assert.Contains(t, err.Error(), tt.reason)
			assert.NotContains(t, err.Error(), "hunter2", "credentials never echoed")
		})
	}
}

func TestEndpointJoinPath(t *testing.T) {
	tests := []struct {
		base, path, want string
	}{
		{"[::1]:8100", "/v1/chat/completions", "http://[::1]:8100/v1/chat/completions"},
		{"http://[::1]:8100/prefix/", "/v1/completions", "http://[::1]:8100/prefix/v1/completions"},
		{"h:1", "v1/models", "http://h:1/v1/models"},
		{"h:1/p", "/health", "http://h:1/p/health"},
	}
	for _, tt := range tests {
		t.Run(tt.base+tt.path, func(t *testing.T) {
			e, err := transport.ParseEndpoint(tt.base)
			require.NoError(t, err)
			assert.Equal(t, tt.want, e.JoinPath(tt.path).String())
			assert.Equal(t, tt.want, e.JoinPath(tt.path).String(), "base URL unchanged")
		})
	}
}

func TestEndpointApply(t *testing.T) {
	e, err := transport.ParseEndpoint("[::1]:8100")
	require.NoError(t, err)
	tests := []struct {
		name   string
		rank   int
		client string // header the client sent, "" for none
		want   []string
	}{
		{"no rank", transport.NoRank, "", nil},
		{"no rank removes client's", transport.NoRank, "7", nil},
		{"rank 0", 0, "", []string{"0"}},
		{"rank replaces client's", 3, "7", []string{"3"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			req, err := http.NewRequestWithContext(t.Context(), http.MethodPost, "http://x/", nil)
			require.NoError(t, err)
			if tt.client != "" {
				req.Header.Set("x-data-parallel-rank", tt.client)
			}
			e.Rank = tt.rank
			h := req.Header.Clone()
			e.Apply(req)
			assert.Equal(t, tt.want, req.Header.Values(transport.RankHeader))
			e.ApplyHeader(h)
			assert.Equal(t, req.Header, h, "ApplyHeader is Apply on the header")
		})
	}
}

type ctxKey struct{}

func TestEndpointNewRequest(t *testing.T) {
	e, err := transport.ParseEndpoint("http://[::1]:8100/p")
	require.NoError(t, err)
	e.Rank = 2
	ctx := context.WithValue(t.Context(), ctxKey{}, "caller")
	req, err := e.NewRequest(ctx, http.MethodPost, "/v1/chat/completions", nil)
	require.NoError(t, err)
	assert.Equal(t, "http://[::1]:8100/p/v1/chat/completions", req.URL.String())
	assert.Equal(t, "[::1]:8100", req.Host)
	assert.Equal(t, "caller", req.Context().Value(ctxKey{}))
	assert.Equal(t, "2", req.Header.Get(transport.RankHeader))
	assert.Equal(t, "http://[::1]:8100/p (rank 2)", e.String())

	u, err := e.PathURL("/v1/chat/completions")
	require.NoError(t, err)
	assert.Equal(t, *req.URL, *u, "PathURL is where NewRequest sends")

	_, err = transport.Endpoint{}.NewRequest(ctx, http.MethodGet, "/", nil)
	assert.ErrorIs(t, err, transport.ErrInvalidEndpoint)
	_, err = transport.Endpoint{}.PathURL("/")
	assert.ErrorIs(t, err, transport.ErrInvalidEndpoint)
	assert.Equal(t, "<nil>", transport.Endpoint{}.String())
}
