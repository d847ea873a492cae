package kvroute

import (
	"context"
	"errors"
	"io"
	"net/http"

	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/transport"
)

// engineClient is the Router's one client of its engines (package
// upstream: the credential, request ids, deadlines, bounded reads, an
// answer other than 2xx drained) with kvroute's error: a failed exchange,
// or an answer other than 2xx, is the *UpstreamError of the leg's phase on
// its engine.
type engineClient struct{ *upstream.Client }

// send sends req, one leg of phase, to ep within d: an error is the leg's
// *UpstreamError. The caller closes the answer's Body.
func (c engineClient) send(req *http.Request, phase Phase, ep *endpoint, d transport.Deadlines) (*http.Response, error) {
	resp, err := c.Send(req, d)
	if err != nil {
		return nil, upstreamError(phase, ep, err)
	}
	return resp, nil
}

// do is send without the check of the answer's status, for a leg that
// acts on the answer's headers first, then calls check.
func (c engineClient) do(req *http.Request, phase Phase, ep *endpoint, d transport.Deadlines) (*http.Response, error) {
	resp, err := c.Do(req, d)
	if err != nil {
		return nil, upstreamError(phase, ep, err)
	}
	return resp, nil
}

// check returns the *UpstreamError of an answer other than 2xx (its body
// drained, bounded), nil for a 2xx one. The caller closes the Body.
func (c engineClient) check(resp *http.Response, phase Phase, ep *endpoint) error {
	if err := c.Check(resp); err != nil {
		return upstreamError(phase, ep, err)
	}
	return nil
}

// upstreamError is err, from the engine client, as phase's *UpstreamError
// on ep: an answer other than 2xx with its status, its body as a client
// may read it (clientSafe) and its Retry-After.
func upstreamError(phase Phase, ep *endpoint, err error) *UpstreamError {
	ue := &UpstreamError{Phase: phase, Endpoint: ep.url, Err: err}
	var se *upstream.StatusError
	if errors.As(err, &se) {
		ue.Status, ue.retryAfter = se.Status, se.RetryAfter
		if se.Body != nil {
			ue.Body = clientSafe(se.Body)
		}
	}
	return ue
}

// legBody is an upstream request body as pieces sent in order: the
// client's bytes with the edited members spliced in (jsonraw.EditPieces),
// written with vectored I/O and never copied whole.
type legBody [][]byte

// size returns the body's length.
func (b legBody) size() int {
	n := 0
	for _, p := range b {
		n += len(p)
	}
	return n
}

// reader returns a new reader of the whole body, holding a reference to
// the pooled client body it aliases (if any) until net/http closes it. The
// caller holds a reference (bodyRef.hold); errBodyReleased when the body
// was released already.
func (b legBody) reader(ref *bodyRef) (*transport.Buffers, error) {
	if ref == nil {
		return transport.NewBuffers(b, nil), nil
	}
	if !ref.hold() {
		return nil, errBodyReleased
	}
	return transport.NewBuffers(b, ref.rel), nil
}

// legs builds the engine requests of one turn: the client's path and
// end-to-end headers, the turn's engine request id, the upstream
// credential and the phase's trace context.
type legs struct {
	req    *Request
	id     string // the X-Request-Id of every engine request of the turn (TurnRecord.EngineRequestID)
	apiKey string // WithUpstreamAPIKey
	trace  *turnTrace
	hdr    http.Header // header's, shared by the turn's legs: read-only
}

// request builds a POST of body to ep for the client's path.
func (l *legs) request(ctx context.Context, phase Phase, ep *endpoint, body legBody) (*http.Request, error) {
	return l.requestTo(ctx, phase, ep, l.req.Path, body, l.id)
}

// requestTo is request for another path of the engine, with request id id.
//
// The URL is a copy of the endpoint's cached one for path, and the legs
// of a turn share one read-only header map (header) unless a leg needs
// headers of its own: a rank pin, a trace context, another request id.
// net/http's RoundTrip only reads Request.Header and transport.Client
// does not copy it, so no one writes the shared map after header.
func (l *legs) requestTo(ctx context.Context, phase Phase, ep *endpoint, path string, body legBody, id string) (*http.Request, error) {
	rd, err := body.reader(l.req.ref)
	if err != nil {
		return nil, &UpstreamError{Phase: phase, Endpoint: ep.url, Err: err}
	}
	u, err := ep.pathURL(path)
	if err != nil {
		_ = rd.Close()
		return nil, &UpstreamError{Phase: phase, Endpoint: ep.url, Err: err}
	}
	// An empty URL parses to an empty *url.URL, which is then overwritten
	// with the cached one: one URL allocation, no parse of the address.
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, "", rd)
	if err != nil {
		_ = rd.Close()
		return nil, &UpstreamError{Phase: phase, Endpoint: ep.url, Err: err}
	}
	*hreq.URL = *u
	hreq.Host = u.Host
	h := l.header()
	if ep.ep.Rank >= 0 || l.trace.tr != nil || id != l.id {
		h = h.Clone()
		h.Set(headerRequestID, id)
		l.trace.inject(ctx, h)
		ep.ep.ApplyHeader(h)
	}
	hreq.Header = h
	hreq.ContentLength = int64(body.size())
	// For net/http's retry of a request a reused connection lost before
	// it was written.
	ref := l.req.ref
	hreq.GetBody = func() (io.ReadCloser, error) { return body.reader(ref) }
	return hreq, nil
}

// header returns the headers every leg of the turn sends, built on the
// first call: the client's end-to-end headers (transport.RequestHeader,
// which drops the rank header), the JSON content type, the turn's engine
// request id and the upstream credential. The map is shared by the turn's
// requests: it must not be modified.
func (l *legs) header() http.Header {
	if l.hdr != nil {
		return l.hdr
	}
	h := transport.RequestHeader(l.req.Header)
	upstream.Header(h, l.id, l.apiKey, true)
	l.hdr = h
	return h
}

var errBodyTooLarge = errors.New("body exceeds the size limit")

// readSized reads a body of the given Content-Length (-1: unknown) into
// one buffer of that size from get (make when nil), or as readLimited when
// the length is unknown or over the limit.
func readSized(r io.Reader, length, limit int64, get func(int) []byte) ([]byte, error) {
	if length <= 0 || length > limit {
		return readLimited(r, limit)
	}
	return readExact(r, length, get)
}

// readExact reads a body of length bytes into a buffer from get (make when
// nil); a longer body is an error.
func readExact(r io.Reader, length int64, get func(int) []byte) ([]byte, error) {
	var b []byte
	if get != nil {
		b = get(int(length))
	} else {
		b = make([]byte, length)
	}
	if _, err := io.ReadFull(r, b); err != nil {
		return nil, err
	}
	var one [1]byte
	if n, _ := r.Read(one[:]); n > 0 {
		return nil, errors.New("the body is longer than its Content-Length")
	}
	return b, nil
}

func readLimited(r io.Reader, limit int64) ([]byte, error) {
	b, err := io.ReadAll(io.LimitReader(r, limit+1))
	if err != nil {
		return nil, err
	}
	if int64(len(b)) > limit {
		return nil, errBodyTooLarge
	}
	return b, nil
}
