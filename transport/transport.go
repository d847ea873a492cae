package transport

import (
	"crypto/tls"
	"errors"
	"net"
	"net/http"
	"net/url"
	"time"
)

// Defaults used by [NewTransport] when no option overrides them.
const (
	// DefaultMaxIdleConnsPerHost keeps enough idle connections per engine
	// for hundreds of concurrent streams (net/http's own default is 2).
	DefaultMaxIdleConnsPerHost = 512
	// DefaultMaxIdleConns bounds idle connections across all engines.
	DefaultMaxIdleConns = 2048
	// DefaultIdleConnTimeout closes connections idle for this long.
	DefaultIdleConnTimeout = 90 * time.Second
	// DefaultDialTimeout bounds establishing one TCP connection.
	DefaultDialTimeout = 5 * time.Second
	// DefaultKeepAlive is the TCP keep-alive probe interval.
	DefaultKeepAlive = 30 * time.Second
	// DefaultTLSHandshakeTimeout bounds a TLS handshake.
	DefaultTLSHandshakeTimeout = 10 * time.Second
)

// NewTransport returns a new [http.Transport] tuned for a router that keeps
// many long streams open to a few engines. Build one and share it (through
// one [Client]) for the life of the process; a transport per request defeats
// connection reuse.
//
// Defaults, each changeable with the option named:
//   - MaxIdleConnsPerHost [DefaultMaxIdleConnsPerHost] ([WithMaxIdleConnsPerHost])
//   - MaxIdleConns [DefaultMaxIdleConns] ([WithMaxIdleConns])
//   - MaxConnsPerHost 0, no limit ([WithMaxConnsPerHost])
//   - IdleConnTimeout [DefaultIdleConnTimeout] ([WithIdleConnTimeout])
//   - dial timeout [DefaultDialTimeout] ([WithDialTimeout])
//   - TCP keep-alive [DefaultKeepAlive] ([WithKeepAlive])
//   - TLSHandshakeTimeout [DefaultTLSHandshakeTimeout] ([WithTLSHandshakeTimeout])
//   - TLSClientConfig nil, system roots ([WithTLSConfig])
//   - Proxy nil: engines are reached directly and proxy environment
//     variables are ignored ([WithProxy])
//
// Fixed settings: ForceAttemptHTTP2 is true (HTTP/2 is negotiated over TLS
// when the engine offers it); DisableCompression is true, so the transport
// neither asks for gzip nor decompresses, and bytes pass through untouched;
// ResponseHeaderTimeout and ExpectContinueTimeout stay 0 because deadlines
// are per phase and per request ([Client.Do] with [Deadlines]).
//
// NewTransport applies all options, then reports every invalid one at once
// in an error wrapping [ErrInvalidConfig]. It does no network I/O.
func NewTransport(opts ...Option) (*http.Transport, error) {
	c := defaultConfig()
	for _, o := range opts {
		o.apply(&c)
	}
	if err := errors.Join(c.errs...); err != nil {
		return nil, err
	}
	return c.transport(), nil
}

func defaultConfig() config {
	return config{
		maxIdleConnsPerHost: DefaultMaxIdleConnsPerHost,
		maxIdleConns:        DefaultMaxIdleConns,
		idleConnTimeout:     DefaultIdleConnTimeout,
		dialTimeout:         DefaultDialTimeout,
		keepAlive:           DefaultKeepAlive,
		tlsHandshakeTimeout: DefaultTLSHandshakeTimeout,
	}
}

type config struct {
	maxIdleConnsPerHost int
	maxIdleConns        int
	maxConnsPerHost     int
	idleConnTimeout     time.Duration
	dialTimeout         time.Duration
	keepAlive           time.Duration
	tlsHandshakeTimeout time.Duration
	tlsConfig           *tls.Config
	proxy               func(*http.Request) (*url.URL, error)
	errs                []error
}

func (c *config) transport() *http.Transport {
	keepAlive := c.keepAlive
	if keepAlive == 0 {
		keepAlive = -1 // net.Dialer: negative disables probes, zero means 15s
	}
	d := &net.Dialer{Timeout: c.dialTimeout, KeepAlive: keepAlive}
	var tc *tls.Config
	if c.tlsConfig != nil {
		tc = c.tlsConfig.Clone()
	}
	return &http.Transport{
		Proxy:               c.proxy,
		DialContext:         vectorDial(d.DialContext),
		TLSClientConfig:     tc,
		TLSHandshakeTimeout: c.tlsHandshakeTimeout,
		MaxIdleConns:        c.maxIdleConns,
		MaxIdleConnsPerHost: c.maxIdleConnsPerHost,
		MaxConnsPerHost:     c.maxConnsPerHost,
		IdleConnTimeout:     c.idleConnTimeout,
		ForceAttemptHTTP2:   true,
		DisableCompression:  true,
	}
}
