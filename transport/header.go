package transport

import (
	"net/http"
	"net/textproto"
	"strings"
)

// hopByHop lists the hop-by-hop headers of RFC 9110 section 7.6.1 plus the
// non-standard Keep-Alive and Proxy-Connection. Any Proxy-* header and the
// headers named by Connection are dropped as well.
var hopByHop = map[string]bool{
	"Connection":        true,
	"Keep-Alive":        true,
	"Te":                true,
	"Trailer":           true,
	"Transfer-Encoding": true,
	"Upgrade":           true,
}

// requestOnly lists the end-to-end request headers that [RequestHeader]
// drops because the router or net/http sets them per upstream request.
var requestOnly = map[string]bool{
	"Host":                 true,
	"Content-Length":       true,
	"Accept-Encoding":      true,
	"Authorization":        true,
	"X-Api-Key":            true,
	"Cookie":               true,
	"X-Data-Parallel-Rank": true,
}

// CopyHeader adds to dst every header of src except the hop-by-hop ones
// (Connection and every header it names, Keep-Alive, any Proxy-* header,
// TE, Trailer, Transfer-Encoding, Upgrade) and Content-Length, which no
// longer holds once bytes are streamed through. Use it to copy an engine's
// response headers to the client. Names are canonicalised; values are
// copied, never shared with src.
func CopyHeader(dst, src http.Header) {
	copyHeader(dst, src, nil)
}

// RequestHeader returns the headers to send upstream for a client request
// with headers in: every end-to-end header of in except
//   - the hop-by-hop ones dropped by [CopyHeader];
//   - Host and Content-Length, which net/http derives from the upstream
//     request;
//   - Accept-Encoding, so that engines answer uncompressed bytes the router
//     can parse;
//   - the client's credentials: Authorization (the router adds its own
//     upstream credential), X-Api-Key (Anthropic's key header) and Cookie;
//     Proxy-Authorization goes with the other Proxy-* headers;
//   - X-Data-Parallel-Rank, which only the router may set ([Endpoint.Apply]).
//
// Everything else, such as X-Request-Id, Content-Type, Accept and
// X-Session-ID, is kept. The result is a new header map sharing no slices
// with in.
func RequestHeader(in http.Header) http.Header {
	out := make(http.Header, len(in))
	copyHeader(out, in, requestOnly)
	return out
}

func copyHeader(dst, src http.Header, extra map[string]bool) {
	listed := connectionTokens(src)
	n := 0
	for k, vv := range src {
		if !dropped(textproto.CanonicalMIMEHeaderKey(k), listed, extra) {
			n += len(vv)
		}
	}
	// One backing array for the values of the names dst does not have;
	// each slice is capped at its own values.
	vals := make([]string, 0, n)
	for k, vv := range src {
		ck := textproto.CanonicalMIMEHeaderKey(k)
		if dropped(ck, listed, extra) {
			continue
		}
		if prev, ok := dst[ck]; ok {
			dst[ck] = append(prev, vv...)
			continue
		}
		start := len(vals)
		vals = append(vals, vv...)
		dst[ck] = vals[start:len(vals):len(vals)]
	}
}

// dropped reports whether the header of canonical name ck is not copied:
// a hop-by-hop one, Content-Length, a Proxy-* one, one listed in
// Connection or one of extra.
func dropped(ck string, listed, extra map[string]bool) bool {
	return hopByHop[ck] || ck == "Content-Length" || strings.HasPrefix(ck, "Proxy-") ||
		listed[ck] || extra[ck]
}

// connectionTokens returns the canonical header names listed in the
// Connection header(s) of h.
func connectionTokens(h http.Header) map[string]bool {
	var listed map[string]bool
	for k, vv := range h {
		if textproto.CanonicalMIMEHeaderKey(k) != "Connection" {
			continue
		}
		for _, v := range vv {
			for tok := range strings.SplitSeq(v, ",") {
				if tok = strings.TrimSpace(tok); tok != "" {
					if listed == nil {
						listed = make(map[string]bool)
					}
					listed[textproto.CanonicalMIMEHeaderKey(tok)] = true
				}
			}
		}
	}
	return listed
}
