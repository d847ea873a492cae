package transport_test

import (
	"net/http"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/bidikv/bidikv/transport"
)

// hopHeaders are dropped by both CopyHeader and RequestHeader.
func hopHeaders() http.Header {
	return http.Header{
		"Connection":          {"keep-alive, X-Hop", "close"},
		"X-Hop":               {"listed in Connection"},
		"Keep-Alive":          {"timeout=5"},
		"Proxy-Authenticate":  {"Basic"},
		"Proxy-Authorization": {"Basic secret"},
		"Proxy-Connection":    {"keep-alive"},
		"Te":                  {"trailers"},
		"Trailer":             {"X-Checksum"},
		"Transfer-Encoding":   {"chunked"},
		"Upgrade":             {"h2c"},
		"Content-Length":      {"42"},
	}
}

func TestCopyHeader(t *testing.T) {
	tests := []struct {
		name string
		dst  http.Header
		src  http.Header
		want http.Header
	}{
		{
			name: "hop-by-hop and Content-Length dropped",
			dst:  http.Header{},
			src: merge(hopHeaders(), http.Header{
				"Content-Type":  {"text/event-stream"},
				"Cache-Control": {"no-cache"},
				"X-Request-Id":  {"r1"},
				"Set-Cookie":    {"a=1", "b=2"},
			}),
			want: http.Header{
				"Content-Type":  {"text/event-stream"},
				"Cache-Control": {"no-cache"},
				"X-Request-Id":  {"r1"},
				"Set-Cookie":    {"a=1", "b=2"},
			},
		},
		{
			name: "values appended to dst",
			dst:  http.Header{"Vary": {"Origin"}},
			src:  http.Header{"Vary": {"Accept"}},
			want: http.Header{"Vary": {"Origin", "Accept"}},
		},
		{
			name: "keys canonicalised, Connection tokens any case",
			dst:  http.Header{},
			src:  http.Header{"connection": {"x-secret"}, "x-secret": {"s"}, "x-model": {"m"}},
			want: http.Header{"X-Model": {"m"}},
		},
		{
			name: "authorization is end-to-end for responses",
			dst:  http.Header{},
			src:  http.Header{"Www-Authenticate": {"Bearer"}, "Authorization": {"x"}},
			want: http.Header{"Www-Authenticate": {"Bearer"}, "Authorization": {"x"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			transport.CopyHeader(tt.dst, tt.src)
			assert.Equal(t, tt.want, tt.dst)
		})
	}
}

func TestCopyHeaderDoesNotAlias(t *testing.T) {
	src := http.Header{"X-A": {"1", "2"}}
	dst := http.Header{}
	transport.CopyHeader(dst, src)
	src["X-A"][0] = "changed"
	assert.Equal(t, []string{"1", "2"}, dst["X-A"])
}

func TestRequestHeader(t *testing.T) {
	in := merge(hopHeaders(), http.Header{
		"Host":                 {"router.example"},
		"Authorization":        {"Bearer client-token"},
		"X-Api-Key":            {"client-key"},
		"Cookie":               {"session=client-secret"},
		"Accept-Encoding":      {"gzip, br"},
		"X-Data-Parallel-Rank": {"3"},
		"Content-Type":         {"application/json"},
		"Accept":               {"text/event-stream"},
		"X-Request-Id":         {"req-1"},
		"X-Session-Id":         {"conv-7"},
		"User-Agent":           {"bench/1"},
	})
	want := http.Header{
		"Content-Type": {"application/json"},
		"Accept":       {"text/event-stream"},
		"X-Request-Id": {"req-1"},
		"X-Session-Id": {"conv-7"},
		"User-Agent":   {"bench/1"},
	}
	got := transport.RequestHeader(in)
	assert.Equal(t, want, got)

	in["X-Request-Id"][0] = "changed"
	assert.Equal(t, "req-1", got.Get("X-Request-Id"), "no shared slices")
	assert.Empty(t, transport.RequestHeader(nil))
}

func merge(hs ...http.Header) http.Header {
	out := http.Header{}
	for _, h := range hs {
		for k, v := range h {
			out[k] = append(out[k], v...)
		}
	}
	return out
}
