package kvroutetest

// WithListenAddress sets the engine's HTTP listen address (default
// "127.0.0.1:0"). Use "[::1]:0" for an engine on IPv6 loopback; its URL is
// then "http://[::1]:port". Only loopback addresses belong in tests.
func WithListenAddress(addr string) Option {
	return optionFunc(func(c *config) { c.addr = addr })
}
