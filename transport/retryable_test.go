package transport_test

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport"
)

func urlErr(err error) error { return &url.Error{Op: "Post", URL: "http://127.0.0.1:1/", Err: err} }

func TestRetryableStatus(t *testing.T) {
	tests := []struct {
		status int
		want   bool
	}{
		{200, false}, {307, false}, {400, false}, {404, false}, {429, false},
		{500, false}, {501, false}, {502, true}, {503, true}, {504, true},
	}
	for _, tt := range tests {
		t.Run(fmt.Sprint(tt.status), func(t *testing.T) {
			assert.Equal(t, tt.want, transport.Retryable(&http.Response{StatusCode: tt.status}, nil))
		})
	}
	t.Run("nothing", func(t *testing.T) {
		assert.False(t, transport.Retryable(nil, nil))
	})
}

func TestRetryableError(t *testing.T) {
	dialOp := func(err error) error { return &net.OpError{Op: "dial", Net: "tcp", Err: err} }
	tests := []struct {
		name string
		err  error
		want bool
	}{
		{"first-byte timeout", urlErr(fmt.Errorf("%w (1s)", transport.ErrFirstByteTimeout)), true},
		{"idle timeout", fmt.Errorf("x: %w", transport.ErrIdleTimeout), false},
		{"total timeout", urlErr(transport.ErrTotalTimeout), false},
		{"caller cancelled", urlErr(context.Canceled), false},
		{"caller deadline", urlErr(context.DeadlineExceeded), false},
		{"refused", urlErr(dialOp(os.NewSyscallError("connect", syscall.ECONNREFUSED))), true},
		{"reset", urlErr(&net.OpError{Op: "read", Err: os.NewSyscallError("read", syscall.ECONNRESET)}), true},
		{"broken pipe", urlErr(&net.OpError{Op: "write", Err: syscall.EPIPE}), true},
		{"host unreachable", urlErr(dialOp(syscall.EHOSTUNREACH)), true},
		{"any dial error", urlErr(dialOp(errors.New("socket: too many open files"))), true},
		{"EOF before response", urlErr(io.EOF), true},
		{"unexpected EOF", urlErr(io.ErrUnexpectedEOF), true},
		{"pooled connection the engine closed", urlErr(errors.New("http: server closed idle connection")), true},
		{"dns temporary", urlErr(&net.DNSError{Err: "server misbehaving", IsTemporary: true}), true},
		{"dns no such host", urlErr(&net.DNSError{Err: "no such host", IsNotFound: true}), false},
		{"net timeout", urlErr(timeoutErr{}), true},
		{"tls certificate", urlErr(x509.UnknownAuthorityError{}), false},
		{"other", errors.New("boom"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			assert.Equal(t, tt.want, transport.Retryable(nil, tt.err))
			// An error decides even when a response is present (a body
			// read that failed).
			assert.Equal(t, tt.want, transport.Retryable(&http.Response{StatusCode: 200}, tt.err))
		})
	}
}

type timeoutErr struct{}

func (timeoutErr) Error() string   { return "i/o timeout" }
func (timeoutErr) Timeout() bool   { return true }
func (timeoutErr) Temporary() bool { return true }

func TestRetryableRealFailures(t *testing.T) {
	c := transport.NewClient(nil)
	t.Run("connection refused", func(t *testing.T) {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		require.NoError(t, err)
		addr := ln.Addr().String()
		require.NoError(t, ln.Close())
		_, err = c.Do(get(t, t.Context(), "http://"+addr+"/"), transport.Deadlines{})
		require.Error(t, err)
		assert.True(t, transport.Retryable(nil, err), "%v", err)
	})
	t.Run("closed without a response", func(t *testing.T) {
		srv, c := newServer(t, "127.0.0.1", http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
			conn, _, err := http.NewResponseController(w).Hijack()
			if err == nil {
				_ = conn.Close()
			}
		}))
		_, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{})
		require.Error(t, err)
		assert.True(t, transport.Retryable(nil, err), "%v", err)
	})
	t.Run("first-byte timeout", func(t *testing.T) {
		srv, c := newServer(t, "127.0.0.1", newStall(t, false, ""))
		_, err := c.Do(get(t, t.Context(), srv.URL), transport.Deadlines{FirstByte: 10 * time.Millisecond})
		require.Error(t, err)
		assert.True(t, transport.Retryable(nil, err), "%v", err)
	})
	t.Run("caller cancelled", func(t *testing.T) {
		s := newStall(t, false, "")
		srv, c := newServer(t, "127.0.0.1", s)
		ctx, cancel := context.WithCancel(t.Context())
		go func() { <-s.arrived; cancel() }()
		_, err := c.Do(get(t, ctx, srv.URL), transport.Deadlines{})
		require.Error(t, err)
		assert.False(t, transport.Retryable(nil, err), "%v", err)
	})
}

func TestRetryAfter(t *testing.T) {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	tests := []struct {
		name   string
		value  string // "" means no header
		want   time.Duration
		wantOK bool
	}{
		{"absent", "", 0, false},
		{"seconds", "120", 120 * time.Second, true},
		{"zero", "0", 0, true},
		{"spaces", "  5 ", 5 * time.Second, true},
		{"negative", "-1", 0, false},
		{"fraction", "1.5", 0, false},
		{"junk after digits", "5s", 0, false},
		{"huge", "99999999999999999999999", time.Duration(1<<63 - 1), true},
		{"beyond duration", "9300000000", time.Duration(1<<63 - 1), true},
		{"IMF-fixdate", "Sun, 01 Mar 2026 12:00:30 GMT", 30 * time.Second, true},
		{"RFC 850", "Sunday, 01-Mar-26 12:01:00 GMT", time.Minute, true},
		{"asctime", "Sun Mar  1 12:00:10 2026", 10 * time.Second, true},
		{"date in the past", "Sun, 01 Mar 2026 11:00:00 GMT", 0, true},
		{"garbage", "soon", 0, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h := http.Header{}
			if tt.value != "" {
				h.Set("Retry-After", tt.value)
			}
			got, ok := transport.RetryAfter(h, now)
			assert.Equal(t, tt.wantOK, ok)
			assert.Equal(t, tt.want, got)
		})
	}
}
