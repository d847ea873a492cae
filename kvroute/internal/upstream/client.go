// Package upstream is the one client of the engines: every request kvroute
// sends an engine (the prefill and decode legs, renders, release requests,
// health probes, reads of /metrics and /v1/models) and every request of the
// capability probe goes through it. It sets the upstream credential and the
// request id, applies the deadlines, bounds what is read of an answer, and
// turns an answer other than 2xx into a *StatusError whose body it has
// drained, bounded. kvroute maps a StatusError to its *UpstreamError, which
// names the phase and the engine.
package upstream

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"time"

	"github.com/bidikv/bidikv/transport"
)

// MaxErrorBody bounds what is kept of an engine's answer other than 2xx;
// the rest is not read.
const MaxErrorBody = 64 << 10

// HeaderRequestID is the header that carries a request's id to the
// engine (vLLM keys its requests by it).
const HeaderRequestID = "X-Request-Id"

// Client sends requests to engines. It is safe for concurrent use.
type Client struct {
	http   *transport.Client
	apiKey string
	clock  func() time.Time
}

// New returns a Client that sends through c, with apiKey as the upstream
// credential (WithUpstreamAPIKey: "Authorization: Bearer apiKey"; none when
// empty), and reads Retry-After dates at clock's time (time.Now when nil).
func New(c *transport.Client, apiKey string, clock func() time.Time) *Client {
	if clock == nil {
		clock = time.Now
	}
	return &Client{http: c, apiKey: apiKey, clock: clock}
}

// StatusError is an engine's answer other than 2xx.
type StatusError struct {
	Status int
	// Body is the answer's body, at most MaxErrorBody bytes; nil when it
	// had none.
	Body []byte
	// RetryAfter is the answer's Retry-After (transport.RetryAfter), 0
	// when it sent none.
	RetryAfter time.Duration
}

// Error returns the status text, which holds nothing the engine wrote.
func (e *StatusError) Error() string { return http.StatusText(e.Status) }

// Answered returns the status of the answer err reports, 0 when err is not
// a *StatusError (no answer came).
func Answered(err error) int {
	var se *StatusError
	if errors.As(err, &se) {
		return se.Status
	}
	return 0
}

// Header sets in h the headers every request to an engine carries: the
// request id (none when id is empty), the upstream credential apiKey
// (WithUpstreamAPIKey; none when empty) and, for a request with a body,
// its JSON content type. The values share one backing array. The legs of
// a turn share one such header map (kvroute's legs.header); a Call gets
// its own.
func Header(h http.Header, id, apiKey string, body bool) {
	vals := []string{"application/json", id, ""}
	if body {
		h["Content-Type"] = vals[0:1:1]
	}
	if id != "" {
		h[HeaderRequestID] = vals[1:2:2]
	}
	if apiKey != "" {
		vals[2] = "Bearer " + apiKey
		h["Authorization"] = vals[2:3:3]
	}
}

// Send sends req, built with the caller's context and headers (Header),
// within d, and checks its answer (Check): the caller closes the Body of
// the response it returns.
func (c *Client) Send(req *http.Request, d transport.Deadlines) (*http.Response, error) {
	resp, err := c.http.Do(req, d)
	if err != nil {
		return nil, err
	}
	if err := c.Check(resp); err != nil {
		_ = resp.Body.Close()
		return nil, err
	}
	return resp, nil
}

// Do sends req as Send does, without checking its answer: for a caller
// that acts on the answer's headers first, then calls Check.
func (c *Client) Do(req *http.Request, d transport.Deadlines) (*http.Response, error) {
	return c.http.Do(req, d)
}

// Check returns nil for a 2xx answer. Any other it reads, up to
// MaxErrorBody, and returns as a *StatusError; the caller still closes the
// Body.
func (c *Client) Check(resp *http.Response) error {
	if resp.StatusCode/100 == 2 {
		return nil
	}
	b, _ := io.ReadAll(io.LimitReader(resp.Body, MaxErrorBody))
	if len(b) == 0 {
		b = nil
	}
	se := &StatusError{Status: resp.StatusCode, Body: b}
	if d, ok := transport.RetryAfter(resp.Header, c.clock()); ok {
		se.RetryAfter = d
	}
	return se
}

// Call is one request of the router's own (not a leg of a turn): a probe,
// a read of /metrics or /v1/models, a release request.
type Call struct {
	Method string // http.MethodGet when empty
	Path   string
	Body   []byte // sent as JSON; nil: none
	// ID is the request's X-Request-Id; none when empty.
	ID string
	// UserAgent names the request in the engine's access log; Go's default
	// when empty.
	UserAgent string
	// Identity sends "Accept-Encoding: identity" (for a RoundTripper that
	// would otherwise ask for a compressed answer); none is sent when
	// false.
	Identity bool
	// Timeout bounds the whole exchange; 0: the context alone.
	Timeout time.Duration
	// Limit is the most of a 2xx answer's body handed to read; the rest
	// is not read.
	Limit int64
}

// Call sends call to ep (pinned to its rank) with the headers of Header,
// and hands the body of a 2xx answer, at
// most call.Limit bytes, to read (nil: it is read and dropped). It returns
// the answer's status (0 when none came) and read's error; an answer other
// than 2xx is a *StatusError.
func (c *Client) Call(ctx context.Context, ep transport.Endpoint, call Call, read func(io.Reader) error) (int, error) {
	if call.Timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, call.Timeout)
		defer cancel()
	}
	method := call.Method
	if method == "" {
		method = http.MethodGet
	}
	var body io.Reader
	if call.Body != nil {
		body = bytes.NewReader(call.Body)
	}
	req, err := ep.NewRequest(ctx, method, call.Path, body)
	if err != nil {
		return 0, err
	}
	Header(req.Header, call.ID, c.apiKey, call.Body != nil)
	if call.Identity {
		req.Header.Set("Accept-Encoding", "identity")
	}
	if call.UserAgent != "" {
		req.Header.Set("User-Agent", call.UserAgent)
	}
	resp, err := c.Send(req, transport.Deadlines{})
	if err != nil {
		return Answered(err), err
	}
	defer resp.Body.Close()
	r := io.LimitReader(resp.Body, call.Limit)
	if read != nil {
		err = read(r)
	}
	_, _ = io.Copy(io.Discard, r)
	return resp.StatusCode, err
}
