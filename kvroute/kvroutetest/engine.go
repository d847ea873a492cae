package kvroutetest

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/bidikv/bidikv/internal/sim"
)

// Engine is a running simulated vLLM server (one process in vLLM terms). Like
// vLLM, one engine acts as prefiller or decoder per request, decided by the
// request's kv_transfer_params. It serves POST /v1/chat/completions,
// POST /v1/completions, POST /v1/responses, POST /v1/messages (and
// /v1/messages/count_tokens), the render endpoints, POST /tokenize,
// GET /health, GET /v1/models and GET /metrics on 127.0.0.1 (the Path
// constants). Safe
// for concurrent use.
type Engine struct {
	sim  *sim.Engine
	srv  *httptest.Server
	ln   *refuser
	once sync.Once
}

// NewEngine starts an engine on 127.0.0.1; tb.Cleanup closes it. Invalid
// options fail the test.
func NewEngine(tb testing.TB, opts ...Option) *Engine {
	tb.Helper()
	e, err := StartEngine(opts...)
	if err != nil {
		tb.Fatalf("%v", err)
	}
	tb.Cleanup(e.Close)
	return e
}

// StartEngine is NewEngine outside a test: the caller must Close the engine.
// Invalid options give an error wrapping ErrInvalidConfig.
func StartEngine(opts ...Option) (*Engine, error) {
	c := defaultConfig()
	for _, o := range opts {
		o.apply(&c)
	}
	if c.reg != nil {
		c.sim.Registry = c.reg.r
	}
	if c.dpSet && c.sim.DPSize < 1 {
		return nil, fmt.Errorf("%w: data-parallel size %d must be at least 1", ErrInvalidConfig, c.sim.DPSize)
	}
	se, err := sim.New(c.sim)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", ErrInvalidConfig, err)
	}
	addr := c.addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		se.Close()
		return nil, fmt.Errorf("kvroutetest: listen: %w", err)
	}
	e := &Engine{sim: se, ln: &refuser{Listener: ln}}
	e.srv = &httptest.Server{Listener: e.ln, Config: &http.Server{Handler: se}}
	e.srv.Start()
	return e, nil
}

// ErrInvalidConfig is wrapped by StartEngine errors for invalid options.
var ErrInvalidConfig = errors.New("kvroutetest: invalid engine option")

// URL returns the HTTP base URL, such as "http://127.0.0.1:41234".
func (e *Engine) URL() string { return e.srv.URL }

// SideChannel returns the side-channel address the engine puts in its
// handles (remote_host, remote_port) from data-parallel rank 0; it differs
// from the HTTP address.
func (e *Engine) SideChannel() (host string, port int) { return e.sim.SideChannel() }

// EngineID returns the engine id put in handles (remote_engine_id) by
// data-parallel rank 0. It changes on Restart unless WithEngineID fixed it.
func (e *Engine) EngineID() string { return e.sim.EngineID() }

// DPSize returns the number of data-parallel ranks (WithDPSize).
func (e *Engine) DPSize() int { return e.sim.DPSize() }

// RankEngineID returns the engine id in the handles of data-parallel rank k:
// EngineID suffixed "_dp<k>" when the engine has several ranks. It changes
// on Restart and panics when k is out of range.
func (e *Engine) RankEngineID(k int) string { return e.sim.RankEngineID(k) }

// RankSideChannel returns the side-channel address in the handles of
// data-parallel rank k: SideChannel's host and its port plus k.
func (e *Engine) RankSideChannel(k int) (host string, port int) { return e.sim.RankSideChannel(k) }

// RankP2PChannel returns data-parallel rank k's peer-tier address
// (WithCPUTier with P2P: SideChannel's host, the P2P port plus k), what a
// request's kv_transfer_params.remote_kv_source names as remote_host and
// remote_port; ok is false without a peer tier.
func (e *Engine) RankP2PChannel(k int) (host string, port int, ok bool) { return e.sim.RankP2PAddr(k) }

// Fingerprint returns the system_fingerprint the engine writes and whether it
// writes the key at all (see WithFingerprint); "" with ok true is null.
func (e *Engine) Fingerprint() (fp string, ok bool) {
	cfg := e.sim.Config()
	p, ok := cfg.SystemFingerprint()
	if p != nil {
		fp = *p
	}
	return fp, ok
}

// Stats returns a snapshot of the counters, after freeing whatever expired.
func (e *Engine) Stats() Stats { return fromSimStats(e.sim.Stats()) }

// FinishedRequests returns the records of the completion requests with
// X-Request-Id id that have ended, in arrival order. Unlike Requests it may
// be called while other requests are being served.
func (e *Engine) FinishedRequests(id string) []RequestRecord {
	rs := e.sim.FinishedRecords(id)
	out := make([]RequestRecord, len(rs))
	for i, r := range rs {
		out[i] = fromSimRecord(r)
	}
	return out
}

// Requests returns a record of every completion request received, in
// arrival order.
func (e *Engine) Requests() []RequestRecord {
	rs := e.sim.Records()
	out := make([]RequestRecord, len(rs))
	for i, r := range rs {
		out[i] = fromSimRecord(r)
	}
	return out
}

// Monotonic returns the engine's monotonic clock in seconds, the clock of
// remote_blocks_expiry_time (its offset is arbitrary).
func (e *Engine) Monotonic() float64 { return e.sim.Mono() }

// FailNext makes the next n completion requests answer status with vLLM's
// error JSON, before anything else happens (no read, no notify).
func (e *Engine) FailNext(n int, status int) { e.sim.FailNext(n, status) }

// CutStreamAfter cuts the next streaming response (the connection is closed
// without a terminating chunk) after k events; the request counts as aborted.
func (e *Engine) CutStreamAfter(k int) { e.sim.CutStreamAfter(k) }

// Stall makes the next completion request wait d in real time after its
// prefill and before answering; a client that goes away meanwhile aborts it.
func (e *Engine) Stall(d time.Duration) { e.sim.Stall(d) }

// Restart loses all blocks and handles, as a restarted vLLM process does:
// a new start time (process_start_time_seconds on GET /metrics) and a new
// engine id unless WithEngineID fixed it; the URL and side channel stay.
func (e *Engine) Restart() { e.sim.Restart() }

// StartTime returns when the engine's current process started, on its
// clock: process_start_time_seconds on GET /metrics.
func (e *Engine) StartTime() time.Time { return e.sim.StartTime() }

// Refuse makes the engine accept and close every new connection while on;
// turning it on also closes open idle connections.
func (e *Engine) Refuse(on bool) {
	e.ln.refusing.Store(on)
	if on {
		e.srv.CloseClientConnections()
	}
}

// Close stops the server and unregisters the side channel. It is safe to
// call more than once.
func (e *Engine) Close() {
	e.once.Do(func() {
		e.srv.CloseClientConnections()
		e.srv.Close()
		e.sim.Close()
	})
}
