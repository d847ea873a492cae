package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"sync"
	"time"
)

// loadCertificate reads tls.crt and tls.key from dir, as llm-d's sidecar
// names them (a Kubernetes TLS Secret mounted as a volume).
func loadCertificate(dir string) (tls.Certificate, error) {
	return tls.LoadX509KeyPair(filepath.Join(dir, "tls.crt"), filepath.Join(dir, "tls.key"))
}

// selfSigned makes the certificate --secure-proxy serves without
// --cert-path: as llm-d's, for testing, valid ten years.
func selfSigned(now time.Time) (tls.Certificate, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return tls.Certificate{}, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return tls.Certificate{}, err
	}
	tmpl := x509.Certificate{
		SerialNumber:          serial,
		Subject:               pkix.Name{Organization: []string{"bidikv sidecar"}},
		NotBefore:             now.Add(-time.Minute).UTC(),
		NotAfter:              now.Add(10 * 365 * 24 * time.Hour).UTC(),
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1), net.IPv6loopback},
		DNSNames:              []string{"localhost"},
	}
	der, err := x509.CreateCertificate(rand.Reader, &tmpl, &tmpl, &key.PublicKey, key)
	if err != nil {
		return tls.Certificate{}, err
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}, nil
}

// certReloader serves the certificate of a directory and reads it again
// when its files change (checked at most every certCheck), as llm-d's
// sidecar does for cert-manager's renewals. A failed read keeps the last
// certificate.
type certReloader struct {
	dir     string
	mu      sync.Mutex
	cert    *tls.Certificate
	mod     time.Time
	checked time.Time
	now     func() time.Time
}

// certCheck is how often a --cert-path directory is looked at again.
const certCheck = 10 * time.Second

func newCertReloader(dir string, now func() time.Time) (*certReloader, error) {
	c := &certReloader{dir: dir, now: now}
	cert, err := loadCertificate(dir)
	if err != nil {
		return nil, err
	}
	c.cert, c.mod, c.checked = &cert, c.modTime(), now()
	return c, nil
}

// modTime is the later modification time of the two files.
func (c *certReloader) modTime() time.Time {
	var t time.Time
	for _, f := range []string{"tls.crt", "tls.key"} {
		if fi, err := os.Stat(filepath.Join(c.dir, f)); err == nil && fi.ModTime().After(t) {
			t = fi.ModTime()
		}
	}
	return t
}

// get is tls.Config's GetCertificate.
func (c *certReloader) get(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if now := c.now(); now.Sub(c.checked) >= certCheck {
		c.checked = now
		if m := c.modTime(); !m.Equal(c.mod) {
			if cert, err := loadCertificate(c.dir); err == nil {
				c.cert, c.mod = &cert, m
			}
		}
	}
	return c.cert, nil
}

// serverTLS is the listeners' TLS configuration for --secure-proxy:
// HTTP/1.1 only (the proxy's routes speak it), TLS 1.2 or later.
func (s *sidecarConfig) serverTLS(now func() time.Time) (*tls.Config, error) {
	cfg := &tls.Config{MinVersion: tls.VersionTLS12, NextProtos: []string{"http/1.1"}}
	if s.certPath != "" {
		r, err := newCertReloader(s.certPath, now)
		if err != nil {
			return nil, fmt.Errorf("--cert-path: %w", err)
		}
		cfg.GetCertificate = r.get
		return cfg, nil
	}
	cert, err := selfSigned(now())
	if err != nil {
		return nil, fmt.Errorf("a self-signed certificate: %w", err)
	}
	cfg.Certificates = []tls.Certificate{cert}
	return cfg, nil
}

// clientTLS is the upstream TLS configuration of a stage
// (--tls-insecure-skip-verify).
func (s *sidecarConfig) clientTLS(stageName string) *tls.Config {
	return &tls.Config{MinVersion: tls.VersionTLS12, InsecureSkipVerify: stage(s.skipVerify, stageName)} //nolint:gosec // llm-d's flag, per stage
}

// stageTransport sends requests to decode engines through the decoder
// stage's transport and every other through the prefiller stage's, when
// their TLS settings differ.
type stageTransport struct {
	prefill, decode http.RoundTripper
	isDecode        func(host string) bool
}

// RoundTrip implements http.RoundTripper.
func (t *stageTransport) RoundTrip(req *http.Request) (*http.Response, error) {
	if t.isDecode(req.URL.Host) {
		return t.decode.RoundTrip(req)
	}
	return t.prefill.RoundTrip(req)
}
