package transport

import (
	"context"
	"errors"
	"io"
	"math"
	"net"
	"net/http"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Retryable reports whether a failed prefill exchange may be retried: resp
// and err are what [Client.Do] returned, or, for a non-streaming leg, the
// response together with the error met while reading its body.
//
// Retryable:
//   - connection failures: refused, reset, aborted, broken pipe, host or
//     network unreachable, any dial error, a timeout of the network stack
//     (dial or TLS handshake), DNS failures other than "no such host", an
//     unexpected EOF (the engine closed the connection before answering),
//     and a pooled keep-alive connection the engine had closed (net/http's
//     "server closed idle connection", which it does not retry itself for a
//     POST);
//   - [ErrFirstByteTimeout]: an engine that accepted the connection but sent
//     no headers in time is probably stalled, and another attempt (or, for
//     the router, another engine) is worth it;
//   - responses with status 502, 503 or 504.
//
// Not retryable: any other status (including 429 and 500), nil resp and err,
// [ErrIdleTimeout] and [ErrTotalTimeout] (the engine answered, or the time
// budget is spent), the caller's own [context.Canceled] or
// [context.DeadlineExceeded], TLS certificate errors, and anything else.
//
// Only the caller knows whether a retry is safe: a decode leg whose bytes
// reached the client must never be retried, and a prefill that carried a KV
// handle must not carry it again.
func Retryable(resp *http.Response, err error) bool {
	if err != nil {
		return retryableError(err)
	}
	if resp == nil {
		return false
	}
	switch resp.StatusCode {
	case http.StatusBadGateway, http.StatusServiceUnavailable, http.StatusGatewayTimeout:
		return true
	}
	return false
}

func retryableError(err error) bool {
	// Order matters: our timeouts and context errors also look like
	// net.Error timeouts.
	switch {
	case errors.Is(err, ErrFirstByteTimeout):
		return true
	case errors.Is(err, ErrIdleTimeout), errors.Is(err, ErrTotalTimeout):
		return false
	case errors.Is(err, context.Canceled), errors.Is(err, context.DeadlineExceeded):
		return false
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return true
	case strings.Contains(err.Error(), "server closed idle connection"):
		// net/http's unexported errServerClosedIdle.
		return true
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET),
		errors.Is(err, syscall.ECONNABORTED), errors.Is(err, syscall.EPIPE),
		errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return true
	}
	var dnsErr *net.DNSError
	if errors.As(err, &dnsErr) {
		return !dnsErr.IsNotFound
	}
	var opErr *net.OpError
	if errors.As(err, &opErr) && opErr.Op == "dial" {
		return true
	}
	var netErr net.Error
	return errors.As(err, &netErr) && netErr.Timeout()
}

// maxRetryAfter bounds what RetryAfter returns so that huge values do not
// overflow time.Duration.
const maxRetryAfter = time.Duration(math.MaxInt64)

// RetryAfter parses the Retry-After header of h, either delta-seconds ("120")
// or an HTTP-date, the latter measured from now. ok is false when the header
// is absent or malformed (negative or fractional seconds, unknown date
// format). A date in the past yields 0 and ok true; absurdly large values
// saturate at the largest time.Duration.
func RetryAfter(h http.Header, now time.Time) (d time.Duration, ok bool) {
	v := strings.TrimSpace(h.Get("Retry-After"))
	if v == "" {
		return 0, false
	}
	if v[0] >= '0' && v[0] <= '9' {
		secs, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			var numErr *strconv.NumError
			if errors.As(err, &numErr) && errors.Is(numErr.Err, strconv.ErrRange) {
				return maxRetryAfter, true
			}
			return 0, false
		}
		if secs > uint64(maxRetryAfter/time.Second) {
			return maxRetryAfter, true
		}
		return time.Duration(secs) * time.Second, true
	}
	t, err := http.ParseTime(v)
	if err != nil {
		return 0, false
	}
	return max(t.Sub(now), 0), true
}
