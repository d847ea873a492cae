package transport

import (
	"crypto/tls"
	"fmt"
	"net/http"
	"net/url"
	"time"
)

// An Option configures [NewTransport].
type Option interface {
	apply(*config)
}

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

func invalid(c *config, format string, args ...any) {
	c.errs = append(c.errs, fmt.Errorf("%w: "+format, append([]any{ErrInvalidConfig}, args...)...))
}

// WithMaxIdleConnsPerHost sets how many idle connections are kept per engine
// (default [DefaultMaxIdleConnsPerHost]). n must be at least 1: zero would
// silently mean net/http's default of 2, which starves concurrent streams.
func WithMaxIdleConnsPerHost(n int) Option {
	return optionFunc(func(c *config) {
		if n < 1 {
			invalid(c, "WithMaxIdleConnsPerHost(%d): must be >= 1", n)
			return
		}
		c.maxIdleConnsPerHost = n
	})
}

// WithMaxIdleConns sets how many idle connections are kept across all
// engines (default [DefaultMaxIdleConns]). Zero means no limit; negative is
// invalid.
func WithMaxIdleConns(n int) Option {
	return optionFunc(func(c *config) {
		if n < 0 {
			invalid(c, "WithMaxIdleConns(%d): must be >= 0 (0 = no limit)", n)
			return
		}
		c.maxIdleConns = n
	})
}

// WithMaxConnsPerHost caps connections per engine, idle or active; requests
// beyond it wait for a free connection (default 0, no limit). Negative is
// invalid.
func WithMaxConnsPerHost(n int) Option {
	return optionFunc(func(c *config) {
		if n < 0 {
			invalid(c, "WithMaxConnsPerHost(%d): must be >= 0 (0 = no limit)", n)
			return
		}
		c.maxConnsPerHost = n
	})
}

// WithIdleConnTimeout sets how long an idle connection is kept (default
// [DefaultIdleConnTimeout]). Zero keeps idle connections until closed by the
// engine; negative is invalid.
func WithIdleConnTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d < 0 {
			invalid(c, "WithIdleConnTimeout(%v): must be >= 0 (0 = no limit)", d)
			return
		}
		c.idleConnTimeout = d
	})
}

// WithDialTimeout bounds establishing one TCP connection (default
// [DefaultDialTimeout]). Zero leaves only the operating system's limit;
// negative is invalid. The request context still bounds every dial.
func WithDialTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d < 0 {
			invalid(c, "WithDialTimeout(%v): must be >= 0 (0 = no limit)", d)
			return
		}
		c.dialTimeout = d
	})
}

// WithKeepAlive sets the TCP keep-alive probe interval (default
// [DefaultKeepAlive]). Zero disables keep-alive probes; negative is invalid.
func WithKeepAlive(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d < 0 {
			invalid(c, "WithKeepAlive(%v): must be >= 0 (0 = disabled)", d)
			return
		}
		c.keepAlive = d
	})
}

// WithTLSHandshakeTimeout bounds a TLS handshake (default
// [DefaultTLSHandshakeTimeout]). Zero means no limit; negative is invalid.
func WithTLSHandshakeTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d < 0 {
			invalid(c, "WithTLSHandshakeTimeout(%v): must be >= 0 (0 = no limit)", d)
			return
		}
		c.tlsHandshakeTimeout = d
	})
}

// WithTLSConfig sets the TLS client configuration for https engines
// (default nil: system roots, no client certificate). The transport keeps a
// clone, so later changes to cfg have no effect. nil restores the default.
func WithTLSConfig(cfg *tls.Config) Option {
	return optionFunc(func(c *config) { c.tlsConfig = cfg })
}

// WithProxy routes upstream requests through the proxy that f returns, as
// [http.Transport.Proxy] does (default nil: direct connections; environment
// variables such as HTTPS_PROXY are not consulted unless f is
// [http.ProxyFromEnvironment]). nil restores the default.
func WithProxy(f func(*http.Request) (*url.URL, error)) Option {
	return optionFunc(func(c *config) { c.proxy = f })
}
