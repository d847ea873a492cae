package transport

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/netip"
	"net/url"
	"strconv"
	"strings"
)

// NoRank is the [Endpoint.Rank] of an engine addressed without a
// data-parallel rank.
const NoRank = -1

// RankHeader is the request header by which vLLM pins a request to one
// data-parallel rank of a server (vLLM reads it case-insensitively).
const RankHeader = "X-Data-Parallel-Rank"

// Endpoint is one engine (or one data-parallel rank of an engine) the router
// sends requests to.
type Endpoint struct {
	// URL is the base URL: scheme http or https, host and optional port,
	// optional path prefix without a trailing slash; no user info, query or
	// fragment. Treat it as read-only: copies of an Endpoint share it.
	URL *url.URL
	// Rank is the data-parallel rank that requests are pinned to with
	// [RankHeader], or [NoRank] (-1) to let the engine choose. Note that the
	// zero value, 0, pins rank 0.
	Rank int
	// Weight is the endpoint's relative share of traffic for endpoint
	// selection; this package does not read it. [ParseEndpoint] sets 1.
	Weight int
}

// ParseEndpoint parses an engine address: "http://host:port",
// "https://host:port", "host:port" (http implied), IPv6 literals in
// brackets ("[::1]:8100", "http://[::1]:8100"), each with an optional path
// prefix ("http://host:8000/engine-a"). Trailing slashes of the prefix are
// removed. The result has Rank [NoRank] and Weight 1.
//
// Rejected, with an error wrapping [ErrInvalidEndpoint] that says why: an
// empty string, schemes other than http and https, a missing or numeric-only
// host, an IPv6 literal without brackets, an empty or out-of-range port,
// user info (credentials do not belong in addresses), a query or a fragment.
func ParseEndpoint(s string) (Endpoint, error) {
	raw := strings.TrimSpace(s)
	fail := func(reason string) (Endpoint, error) {
		shown := raw
		if strings.Contains(shown, "@") {
			shown = "<redacted>"
		}
		return Endpoint{}, fmt.Errorf("%w %q: %s", ErrInvalidEndpoint, shown, reason)
	}
	if raw == "" {
		return fail("empty address")
	}
	withScheme := raw
	if !strings.Contains(raw, "://") {
		withScheme = "http://" + raw
	}
	hostport := withScheme[strings.Index(withScheme, "://")+3:]
	if i := strings.IndexAny(hostport, "/?#"); i >= 0 {
		hostport = hostport[:i]
	}
	if strings.Count(hostport, ":") > 1 && !strings.HasPrefix(hostport, "[") && !strings.Contains(hostport, "@") {
		return fail("IPv6 literal must be in brackets, as in [::1]:8100")
	}
	u, err := url.Parse(withScheme)
	if err != nil {
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err
		}
		return fail(err.Error())
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return fail("scheme must be http or https")
	case u.Opaque != "":
		return fail("not a host address")
	case u.User != nil:
		return fail("user info is not allowed")
	case u.RawQuery != "" || u.ForceQuery:
		return fail("query is not allowed")
	case u.Fragment != "" || strings.Contains(raw, "#"):
		return fail("fragment is not allowed")
	}
	host := u.Hostname()
	if host == "" {
		return fail("missing host")
	}
	if strings.Contains(host, ":") {
		addr, err := netip.ParseAddr(host)
		if err != nil {
			return fail("invalid IPv6 literal")
		}
		if !validZone(addr.Zone()) {
			return fail("invalid IPv6 zone (an interface name: letters, digits, '.', '_', '-')")
		}
	} else if strings.Trim(host, "0123456789") == "" {
		return fail("numeric-only host (missing host before the port?)")
	}
	if strings.HasSuffix(u.Host, ":") {
		return fail("empty port")
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n < 1 || n > 65535 {
			return fail("port must be between 1 and 65535")
		}
	}
	u.Path = strings.TrimRight(u.Path, "/")
	u.RawPath = strings.TrimRight(u.RawPath, "/")
	return Endpoint{URL: u, Rank: NoRank, Weight: 1}, nil
}

// String returns the base URL followed by " (rank N)" when the endpoint is
// pinned to a rank, e.g. "http://[::1]:8100 (rank 2)".
func (e Endpoint) String() string {
	if e.URL == nil {
		return "<nil>"
	}
	s := e.URL.Redacted()
	if e.Rank >= 0 {
		s += " (rank " + strconv.Itoa(e.Rank) + ")"
	}
	return s
}

// JoinPath returns a new URL: the endpoint's base URL with the path elements
// appended, as [url.URL.JoinPath] does, so "/v1/chat/completions" on
// "http://[::1]:8100/prefix" gives "http://[::1]:8100/prefix/v1/chat/completions".
// The elements are paths only; set a query on the result.
func (e Endpoint) JoinPath(elem ...string) *url.URL {
	return e.URL.JoinPath(elem...)
}

// Apply pins req to the endpoint's data-parallel rank by setting
// [RankHeader], or removes that header when Rank is negative, so that a
// client can never choose the rank.
func (e Endpoint) Apply(req *http.Request) {
	if req.Header == nil {
		req.Header = make(http.Header)
	}
	e.ApplyHeader(req.Header)
}

// ApplyHeader is [Endpoint.Apply] for a request's header h, which must not
// be nil.
func (e Endpoint) ApplyHeader(h http.Header) {
	if e.Rank >= 0 {
		h.Set(RankHeader, strconv.Itoa(e.Rank))
		return
	}
	h.Del(RankHeader)
}

// PathURL returns the URL of a request to path on the endpoint, parsed
// from its string as [Endpoint.NewRequest] sends it (JoinPath's result
// leaves a relative path on a base URL without one, which the string
// form resolves). An Endpoint without URL is an error wrapping
// [ErrInvalidEndpoint].
func (e Endpoint) PathURL(path string) (*url.URL, error) {
	if e.URL == nil {
		return nil, fmt.Errorf("%w: no URL", ErrInvalidEndpoint)
	}
	return url.Parse(e.JoinPath(path).String())
}

// NewRequest builds a request to path on the endpoint ([Endpoint.PathURL])
// with the caller's context, as [http.NewRequestWithContext] does, then
// calls [Endpoint.Apply]. An Endpoint without URL is an error wrapping
// [ErrInvalidEndpoint].
func (e Endpoint) NewRequest(ctx context.Context, method, path string, body io.Reader) (*http.Request, error) {
	u, err := e.PathURL(path)
	if err != nil {
		return nil, err
	}
	req, err := http.NewRequestWithContext(ctx, method, u.String(), body)
	if err != nil {
		return nil, err
	}
	e.Apply(req)
	return req, nil
}

// validZone reports whether an IPv6 zone is an interface name or index
// (letters, digits, '.', '_', '-'), which survives a round trip through a
// URL; any other byte would not.
func validZone(z string) bool {
	for i := 0; i < len(z); i++ {
		c := z[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '.' || c == '_' || c == '-') {
			return false
		}
	}
	return true
}
