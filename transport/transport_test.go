package transport_test

import (
	"crypto/tls"
	"io"
	"net/http"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/transport"
)

func TestNewTransportDefaults(t *testing.T) {
	tr, err := transport.NewTransport()
	require.NoError(t, err)
	defer tr.CloseIdleConnections()
	assert.Equal(t, transport.DefaultMaxIdleConnsPerHost, tr.MaxIdleConnsPerHost)
	assert.Equal(t, transport.DefaultMaxIdleConns, tr.MaxIdleConns)
	assert.Zero(t, tr.MaxConnsPerHost)
	assert.Equal(t, transport.DefaultIdleConnTimeout, tr.IdleConnTimeout)
	assert.Equal(t, transport.DefaultTLSHandshakeTimeout, tr.TLSHandshakeTimeout)
	assert.Zero(t, tr.ResponseHeaderTimeout, "deadlines are per phase")
	assert.True(t, tr.ForceAttemptHTTP2)
	assert.True(t, tr.DisableCompression)
	assert.Nil(t, tr.Proxy, "environment proxies are not used")
	assert.NotNil(t, tr.DialContext)

	// The transport works and does not ask for compression.
	srv, _ := newServer(t, "127.0.0.1", http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, "accept-encoding="+r.Header.Get("Accept-Encoding"))
	}))
	resp, err := transport.NewClient(tr).Do(get(t, t.Context(), srv.URL), transport.Deadlines{})
	require.NoError(t, err)
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	require.NoError(t, err)
	assert.Equal(t, "accept-encoding=", string(b))
}

func TestNewTransportOptions(t *testing.T) {
	tlsCfg := &tls.Config{ServerName: "engine.internal", MinVersion: tls.VersionTLS13}
	proxyURL := &url.URL{Scheme: "http", Host: "proxy:3128"}
	tr, err := transport.NewTransport(
		transport.WithMaxIdleConnsPerHost(64),
		transport.WithMaxIdleConns(0),
		transport.WithMaxConnsPerHost(128),
		transport.WithIdleConnTimeout(time.Minute),
		transport.WithDialTimeout(time.Second),
		transport.WithKeepAlive(0),
		transport.WithTLSHandshakeTimeout(3*time.Second),
		transport.WithTLSConfig(tlsCfg),
		transport.WithProxy(http.ProxyURL(proxyURL)),
	)
	require.NoError(t, err)
	assert.Equal(t, 64, tr.MaxIdleConnsPerHost)
	assert.Zero(t, tr.MaxIdleConns)
	assert.Equal(t, 128, tr.MaxConnsPerHost)
	assert.Equal(t, time.Minute, tr.IdleConnTimeout)
	assert.Equal(t, 3*time.Second, tr.TLSHandshakeTimeout)
	require.NotNil(t, tr.TLSClientConfig)
	assert.NotSame(t, tlsCfg, tr.TLSClientConfig, "cloned")
	assert.Equal(t, "engine.internal", tr.TLSClientConfig.ServerName)
	require.NotNil(t, tr.Proxy)
	got, err := tr.Proxy(&http.Request{URL: &url.URL{Scheme: "http", Host: "e:1"}})
	require.NoError(t, err)
	assert.Equal(t, proxyURL, got)
}

func TestNewTransportRejects(t *testing.T) {
	tests := []struct {
		name string
		opt  transport.Option
	}{
		{"WithMaxIdleConnsPerHost", transport.WithMaxIdleConnsPerHost(0)},
		{"WithMaxIdleConns", transport.WithMaxIdleConns(-1)},
		{"WithMaxConnsPerHost", transport.WithMaxConnsPerHost(-1)},
		{"WithIdleConnTimeout", transport.WithIdleConnTimeout(-time.Second)},
		{"WithDialTimeout", transport.WithDialTimeout(-1)},
		{"WithKeepAlive", transport.WithKeepAlive(-1)},
		{"WithTLSHandshakeTimeout", transport.WithTLSHandshakeTimeout(-1)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tr, err := transport.NewTransport(tt.opt)
			assert.Nil(t, tr)
			require.ErrorIs(t, err, transport.ErrInvalidConfig)
			assert.Contains(t, err.Error(), tt.name)
		})
	}
	t.Run("all errors reported", func(t *testing.T) {
		_, err := transport.NewTransport(transport.WithDialTimeout(-1), transport.WithKeepAlive(-1))
		require.Error(t, err)
		assert.Equal(t, 2, strings.Count(err.Error(), "transport: invalid configuration"))
	})
}
