package transport

import (
	"context"
	"crypto/tls"
	"encoding/base64"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
	"sync/atomic"
	"time"
)

// Deadlines bounds the phases of one upstream exchange. A zero field means
// no limit for that phase; negative fields are invalid.
type Deadlines struct {
	// FirstByte bounds the time from the start of Do until the response
	// headers arrive: dialing, sending the request body and the engine's
	// queueing and prefill all count.
	FirstByte time.Duration
	// Idle bounds the gap between body reads that return data, measured
	// from the arrival of the headers and then from each read that returned
	// at least one byte. The clock runs whether or not the caller is
	// reading, so a caller that stops reading for longer than Idle times out
	// too.
	Idle time.Duration
	// Total bounds the whole exchange, from the start of Do until the body
	// has been read to its end or closed.
	Total time.Duration
}

func (d Deadlines) validate() error {
	if d.FirstByte < 0 || d.Idle < 0 || d.Total < 0 {
		return fmt.Errorf("%w: negative deadline in %+v (0 = no limit)", ErrInvalidConfig, d)
	}
	return nil
}

// Client sends upstream requests with per-phase [Deadlines]. It never sets
// a whole-request timeout, which would cut long streams, and never follows
// redirects: a 3xx response is returned as is. A Client is safe for
// concurrent use; share one per transport.
//
// A Client hands each request straight to its RoundTripper, as an
// [http.Client] without cookie jar, timeout or redirects would, but
// without http.Client's per-request copy of the headers (kept there for
// redirects, which a Client never follows).
type Client struct {
	rt    http.RoundTripper
	clock clock
}

// NewClient returns a Client sending through rt, typically the transport
// from [NewTransport]. A nil rt gets a new transport with the defaults of
// [NewTransport].
func NewClient(rt http.RoundTripper) *Client {
	if rt == nil {
		c := defaultConfig()
		rt = c.transport()
	}
	return &Client{rt: rt, clock: realClock{}}
}

// Do sends req and returns the response with its Body wrapped to enforce d.
// Build req with the caller's context (http.NewRequestWithContext or
// [Endpoint.NewRequest]) so that a client that goes away cancels the
// upstream call.
//
// When a deadline fires, the request's context is cancelled and the error
// from Do or from Body.Read wraps [ErrFirstByteTimeout], [ErrIdleTimeout] or
// [ErrTotalTimeout]; such errors report Timeout() == true and never match
// [context.Canceled]. When the caller's context ends first, the error
// matches [context.Canceled] (or [context.DeadlineExceeded]), whatever cause
// it was cancelled with. An error from Do is a [*url.Error], as from
// [http.Client.Do].
//
// The caller must close the returned Body, as with [http.Client.Do]; Close
// (or reading to io.EOF) stops every timer. As with http.Client.Do, req.Body
// is closed even on error. A negative field in d is an error wrapping
// [ErrInvalidConfig]. Do does not modify req, its Header or its URL
// (net/http's RoundTrip only reads them), so requests may share a
// read-only Header map.
func (c *Client) Do(req *http.Request, d Deadlines) (*http.Response, error) {
	if err := d.validate(); err != nil {
		closeBody(req)
		return nil, err
	}
	if req.URL == nil {
		closeBody(req)
		return nil, &url.Error{Op: urlErrorOp(req.Method), Err: errors.New("http: nil Request.URL")}
	}
	if req.RequestURI != "" {
		closeBody(req)
		return nil, &url.Error{Op: urlErrorOp(req.Method), URL: req.URL.Redacted(),
			Err: errors.New("http: Request.RequestURI can't be set in client requests")}
	}
	parent := req.Context()
	ctx, cancel := context.WithCancelCause(parent)
	// The exchange lives in the body that enforces it: one allocation.
	b := &body{x: exchange{parent: parent, ctx: ctx, cancel: cancel}}
	x := &b.x
	if d.Total > 0 {
		x.total = c.clock.AfterFunc(d.Total, func() {
			x.cancel(&timeoutError{kind: ErrTotalTimeout, limit: d.Total})
		})
	}
	// One timer serves the first-byte deadline and then the idle one.
	x.firstLimit, x.idleLimit = d.FirstByte, d.Idle
	if d.FirstByte > 0 {
		x.phase = c.clock.AfterFunc(d.FirstByte, x.expirePhase)
	}

	resp, err := c.send(req.WithContext(ctx))
	armed := x.phase != nil && x.phase.Stop()
	if err == nil && ctx.Err() != nil {
		// A deadline fired or the caller gave up just as the headers
		// arrived: the body is already doomed.
		_ = resp.Body.Close()
		resp, err = nil, context.Cause(ctx)
	}
	if err != nil {
		err = x.fix(&url.Error{Op: urlErrorOp(req.Method), URL: req.URL.Redacted(), Err: err}, func(te *timeoutError) error {
			return &url.Error{Op: urlErrorOp(req.Method), URL: req.URL.Redacted(), Err: te}
		})
		x.finish()
		cancel(nil)
		return nil, err
	}
	if d.Idle > 0 {
		switch {
		case x.phase == nil:
			x.idling.Store(true)
			x.phase = c.clock.AfterFunc(d.Idle, x.expirePhase)
		case armed:
			// Stopped before it fired: re-armed as the idle deadline.
			x.idling.Store(true)
			x.phase.Reset(d.Idle)
		default:
			// The first-byte deadline fired as the headers arrived: its
			// callback cancels the exchange with ErrFirstByteTimeout.
		}
	}
	b.rc = resp.Body
	resp.Body = b
	return resp, nil
}

// send hands req to the RoundTripper, as http.Client's own send does:
// the body is closed on error, a nil Body becomes http.NoBody, and the
// Basic credentials of a URL's user info are sent when the request has no
// Authorization header.
func (c *Client) send(req *http.Request) (*http.Response, error) {
	if req.Header == nil {
		req.Header = make(http.Header) // req is Do's own copy
	}
	if u := req.URL.User; u != nil && req.Header.Get("Authorization") == "" {
		pass, _ := u.Password()
		req.Header = req.Header.Clone()
		req.Header.Set("Authorization", "Basic "+base64.StdEncoding.EncodeToString([]byte(u.Username()+":"+pass)))
	}
	resp, err := c.rt.RoundTrip(req)
	if err != nil {
		if resp != nil && resp.Body != nil {
			_ = resp.Body.Close()
		}
		closeBody(req)
		var rhe tls.RecordHeaderError
		if errors.As(err, &rhe) && string(rhe.RecordHeader[:]) == "HTTP/" {
			err = http.ErrSchemeMismatch
		}
		return nil, err
	}
	if resp == nil {
		closeBody(req)
		return nil, fmt.Errorf("http: RoundTripper implementation (%T) returned a nil *Response with a nil error", c.rt)
	}
	if resp.Body == nil {
		resp.Body = http.NoBody
	}
	return resp, nil
}

// closeBody closes req's body, if it has one.
func closeBody(req *http.Request) {
	if req.Body != nil {
		_ = req.Body.Close()
	}
}

// urlErrorOp mirrors net/http: "POST" becomes "Post".
func urlErrorOp(method string) string {
	if method == "" {
		return "Get"
	}
	return method[:1] + strings.ToLower(method[1:])
}

// exchange holds the cancellation and timers of one Do call.
type exchange struct {
	parent context.Context
	ctx    context.Context
	cancel context.CancelCauseFunc

	total timer
	// phase is the first-byte timer until the headers arrive, then the
	// idle one (idling set), which the body restarts.
	phase      timer
	idling     atomic.Bool
	firstLimit time.Duration
	idleLimit  time.Duration
	stopped    bool // guarded by body.mu once the body exists
}

// expirePhase is the phase timer's callback.
func (x *exchange) expirePhase() {
	if x.idling.Load() {
		x.cancel(&timeoutError{kind: ErrIdleTimeout, limit: x.idleLimit})
		return
	}
	x.cancel(&timeoutError{kind: ErrFirstByteTimeout, limit: x.firstLimit})
}

// finish stops every timer. It is idempotent.
func (x *exchange) finish() {
	x.stopped = true
	if x.total != nil {
		x.total.Stop()
	}
	if x.phase != nil {
		x.phase.Stop()
	}
}

// fix makes err report why the exchange ended: one of our deadlines (built
// by wrap unless err already carries it), or the caller's cancellation,
// which must stay matchable as context.Canceled even when the caller
// supplied its own cause.
func (x *exchange) fix(err error, wrap func(*timeoutError) error) error {
	cause := context.Cause(x.ctx)
	if cause == nil {
		return err
	}
	var te *timeoutError
	if errors.As(cause, &te) {
		if errors.Is(err, te.kind) {
			return err
		}
		return wrap(te)
	}
	if perr := x.parent.Err(); perr != nil && !errors.Is(err, perr) {
		return fmt.Errorf("%w: %w", err, perr)
	}
	return err
}
