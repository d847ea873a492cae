package transport

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"net/url"
	"strings"
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
// [http.Client.Timeout], which would cut long streams, and never follows
// redirects: a 3xx response is returned as is. A Client is safe for
// concurrent use; share one per transport.
type Client struct {
	hc    *http.Client
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
	return &Client{
		hc: &http.Client{
			Transport: rt,
			CheckRedirect: func(*http.Request, []*http.Request) error {
				return http.ErrUseLastResponse
			},
		},
		clock: realClock{},
	}
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
// it was cancelled with.
//
// The caller must close the returned Body, as with [http.Client.Do]; Close
// (or reading to io.EOF) stops every timer. As with http.Client.Do, req.Body
// is closed even on error. A negative field in d is an error wrapping
// [ErrInvalidConfig].
func (c *Client) Do(req *http.Request, d Deadlines) (*http.Response, error) {
	if err := d.validate(); err != nil {
		if req.Body != nil {
			_ = req.Body.Close()
		}
		return nil, err
	}
	parent := req.Context()
	ctx, cancel := context.WithCancelCause(parent)
	x := &exchange{parent: parent, ctx: ctx, cancel: cancel}
	if d.Total > 0 {
		x.total = c.clock.AfterFunc(d.Total, x.expire(ErrTotalTimeout, d.Total))
	}
	var first timer
	if d.FirstByte > 0 {
		first = c.clock.AfterFunc(d.FirstByte, x.expire(ErrFirstByteTimeout, d.FirstByte))
	}

	resp, err := c.hc.Do(req.WithContext(ctx))
	if first != nil {
		first.Stop()
	}
	if err == nil && ctx.Err() != nil {
		// A deadline fired or the caller gave up just as the headers
		// arrived: the body is already doomed.
		_ = resp.Body.Close()
		resp, err = nil, &url.Error{Op: urlErrorOp(req.Method), URL: req.URL.Redacted(), Err: context.Cause(ctx)}
	}
	if err != nil {
		err = x.fix(err, func(te *timeoutError) error {
			return &url.Error{Op: urlErrorOp(req.Method), URL: req.URL.Redacted(), Err: te}
		})
		x.finish()
		cancel(nil)
		return nil, err
	}
	if d.Idle > 0 {
		x.idleLimit = d.Idle
		x.idle = c.clock.AfterFunc(d.Idle, x.expire(ErrIdleTimeout, d.Idle))
	}
	resp.Body = &body{rc: resp.Body, x: x}
	return resp, nil
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

	total     timer
	idle      timer
	idleLimit time.Duration
	stopped   bool // guarded by body.mu once the body exists
}

func (x *exchange) expire(kind error, limit time.Duration) func() {
	return func() { x.cancel(&timeoutError{kind: kind, limit: limit}) }
}

// finish stops every timer. It is idempotent.
func (x *exchange) finish() {
	x.stopped = true
	if x.total != nil {
		x.total.Stop()
	}
	if x.idle != nil {
		x.idle.Stop()
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
