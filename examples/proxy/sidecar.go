package main

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/transport"
)

// pathGenerate is vLLM's token-in generate route, which llm-d's sidecar
// serves: the router has no such API, so the sidecar serves it on the
// local engine alone (counted in sidecar_local_turns_total, reason
// generate).
const pathGenerate = "/inference/v1/generate"

// sidecar serves llm-d's P/D sidecar contract over a stack: the header's
// prefill engine and the local decode engine of each data-parallel rank.
type sidecar struct {
	cfg          *sidecarConfig
	st           *stack
	log          *slog.Logger
	pools        *pools
	allow        *allowlist
	locals       []string // the local engine's ranks (URLs, as the router names them)
	maxBodyBytes int64
	upstream     string
	rt           http.RoundTripper
	engines      *transport.Client
	sample       func(n int) int // --enable-prefiller-sampling's pick

	localTurns *prometheus.CounterVec // path, reason
	denied     prometheus.Counter
	onceGen    sync.Once
}

// standInPrefill is the prefill engine the router is built with when no
// prefill pool is given (kvroute.New needs one); the pools replace it
// before any request is served.
const standInPrefill = "http://127.0.0.1:1"

// runSidecar is `bidikv-proxy sidecar`: it serves until ctx is done, then
// drains as the proxy does.
func runSidecar(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	scfg, err := parseSidecar(args, getenv, stdout)
	if err != nil {
		return err
	}
	log := newLogger(scfg.config, stderr)
	for _, w := range scfg.warnings {
		log.Warn(w)
	}
	if err := resolveDNS(ctx, scfg.config, nil, log); err != nil {
		return err
	}
	sc, err := newSidecar(ctx, scfg, getenv, stdout, log)
	if err != nil {
		return err
	}
	defer sc.st.close()
	waitDNS, err := watchDNS(ctx, scfg.config, nil, sc.pools.set, sc.st.health, sc.st.metrics, log)
	if err != nil {
		return err
	}
	defer waitDNS()
	return sc.serve(ctx, stdout)
}

// newSidecar builds the sidecar's stack: the router's prefill legs go to
// the header's engine and its decode legs to the local one (pinned), its
// transport reads P's cached_tokens (cachedTap) and reaches each stage
// with that stage's TLS settings.
func newSidecar(ctx context.Context, scfg *sidecarConfig, getenv func(string) string, stdout io.Writer, log *slog.Logger) (*sidecar, error) {
	sc := &sidecar{cfg: scfg, log: log, locals: scfg.localURLs(), maxBodyBytes: scfg.maxBodyBytes,
		upstream: scfg.upstreamAPIKey, sample: rand.IntN}
	p, err := newPools(time.Now, stage(scfg.enableTLS, stagePrefiller), sc.locals, scfg.prefillURLs, scfg.decodeURLs)
	if err != nil {
		return nil, fmt.Errorf("%w: %v", errUsage, err)
	}
	sc.pools = p
	sc.allow = newAllowlist(scfg.ssrf, p, scfg.ssrfAllow)
	// The router's first sets: the local ranks and the other decode pods;
	// the prefill pool or a stand-in (the pools apply theirs at once).
	scfg.decodeURLs = append(append([]string(nil), sc.locals...), scfg.decodeURLs...)
	if len(scfg.prefillURLs) == 0 {
		scfg.prefillURLs = []string{standInPrefill}
	}
	var decodeTr *http.Transport
	hooks := stackHooks{
		transport: []transport.Option{transport.WithTLSConfig(scfg.clientTLS(stagePrefiller)),
			transport.WithMaxIdleConnsPerHost(scfg.maxIdlePerHost)},
		options: []kvroute.Option{
			kvroute.WithSelector(&pinned{}),
			kvroute.WithFailover(kvroute.Failover{LocalPrefill: scfg.localFallback, PrefillRetry: scfg.retryPolicy()}),
		},
	}
	if stage(scfg.skipVerify, stagePrefiller) != stage(scfg.skipVerify, stageDecoder) {
		decodeTr, err = transport.NewTransport(transport.WithTLSConfig(scfg.clientTLS(stageDecoder)),
			transport.WithMaxIdleConnsPerHost(scfg.maxIdlePerHost))
		if err != nil {
			return nil, err
		}
	}
	hooks.wrap = func(rt http.RoundTripper) http.RoundTripper {
		if decodeTr != nil {
			rt = &stageTransport{prefill: rt, decode: decodeTr, isDecode: p.isDecode}
		}
		return cachedTap{next: rt}
	}
	tracingEnv := func(k string) string {
		if !scfg.tracing && strings.HasPrefix(k, "OTEL_") {
			return "" // --tracing off: no spans, whatever OTEL_* says
		}
		return getenv(k)
	}
	st, err := newStack(ctx, scfg.config, tracingEnv, stdout, log, hooks)
	if err != nil {
		return nil, err
	}
	if decodeTr != nil {
		st.closers = append([]func(){decodeTr.CloseIdleConnections}, st.closers...)
	}
	sc.st, sc.rt = st, st.rt
	sc.engines = transport.NewClient(st.rt)
	if err := p.attach(st.router, st.health); err != nil {
		st.close()
		return nil, err
	}
	sc.registerMetrics()
	return sc, nil
}

// retryPolicy is --prefill-max-retries and --prefill-retry-backoff as
// kvroute's retry policy: a fixed backoff without jitter, as llm-d's.
func (s *sidecarConfig) retryPolicy() transport.RetryPolicy {
	return transport.RetryPolicy{MaxAttempts: s.prefillRetries + 1, InitialInterval: s.prefillBackoff,
		MaxInterval: s.prefillBackoff, Multiplier: 1, RandomizationFactor: -1}
}

// registerMetrics adds the sidecar's counters and the endpoint picker's
// figures of the local engine to the stack's registry.
func (sc *sidecar) registerMetrics() {
	reg := sc.st.metrics.reg
	sc.localTurns = prometheus.NewCounterVec(prometheus.CounterOpts{Namespace: namespace, Name: "sidecar_local_turns_total",
		Help: "Requests the sidecar served on the local engine alone, by API path and reason: no_prefill_header (as llm-d's sidecar), generate (/inference/v1/generate, which bidikv serves without a prefill leg)."},
		[]string{"path", "reason"})
	sc.denied = prometheus.NewCounter(prometheus.CounterOpts{Namespace: namespace, Name: "sidecar_ssrf_denied_total",
		Help: "Requests refused with 403 because x-prefiller-host-port named an engine outside the SSRF allowlist."})
	local := func(f func(kvroute.DecodeKV) float64) float64 {
		var sum float64
		for _, kv := range sc.st.router.DecodeKV() {
			for _, l := range sc.locals {
				if kv.Endpoint == l {
					sum += f(kv)
				}
			}
		}
		return sum
	}
	gauge := func(name, help string, f func() float64) prometheus.Collector {
		return prometheus.NewGaugeFunc(prometheus.GaugeOpts{Namespace: namespace, Name: name, Help: help}, f)
	}
	held := func() float64 { return local(func(kv kvroute.DecodeKV) float64 { return float64(kv.HeldTokens) }) }
	ratio := func(of func(kvroute.DecodeKV) int64) func() float64 {
		return func() float64 {
			d := local(func(kv kvroute.DecodeKV) float64 { return float64(of(kv)) })
			if d <= 0 {
				return 0
			}
			return held() / d
		}
	}
	reg.MustRegister(sc.localTurns, sc.denied,
		gauge("sidecar_held_tokens", "KV the local engine pins for this sidecar's retained handles (whole blocks × block size): conversations that will come back to this pod's KV.", held),
		gauge("sidecar_reclaimable_ratio", "Share of the local engine's KV capacity held for retained handles, which releases would free for new requests (0: capacity unknown).",
			ratio(func(kv kvroute.DecodeKV) int64 { return kv.Capacity })),
		gauge("sidecar_budget_pressure", "Held tokens over the decode-memory budget of the local engine (1: at the budget; 0: no budget).",
			ratio(func(kv kvroute.DecodeKV) int64 { return kv.Budget })))
}

// prefillTarget reads and strips x-prefiller-host-port as llm-d's
// sidecar: one value, a comma-separated list or repeated headers; the
// first entry, or a random one with --enable-prefiller-sampling.
func (sc *sidecar) prefillTarget(r *http.Request) string {
	hosts := r.Header.Values(headerPrefillHostPort)
	r.Header.Del(headerPrefillHostPort)
	if len(hosts) == 1 {
		hosts = strings.Split(hosts[0], ",")
	}
	switch {
	case len(hosts) == 0:
		return ""
	case sc.cfg.samplePrefill:
		return strings.TrimSpace(hosts[sc.sample(len(hosts))])
	}
	return strings.TrimSpace(hosts[0])
}

// turn serves one of the APIs on the listener of rank.
func (sc *sidecar) turn(rank int, routed http.Handler, plain func(rank int, reason string) http.Handler) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		target := sc.prefillTarget(r)
		// Headers of llm-d features bidikv does not run: the encoder stage
		// (no --ec-connector: llm-d ignores it too) and P2P pulls (refused
		// at start-up: --enable-p2p-pull).
		r.Header.Del(headerKVCacheSource)
		r.Header.Del(headerEncoderHosts)
		if target == "" {
			if rank == 0 {
				if dp := r.Header.Get(headerDataParallel); dp != "" {
					rk, ok := sc.dpRank(dp)
					if !ok {
						writeError(w, r, http.StatusBadRequest, "x-data-parallel-host-port "+dp+" is not a rank of this pod")
						return
					}
					rank = rk
				}
			}
			plain(rank, "no_prefill_header").ServeHTTP(w, r)
			return
		}
		if !sc.allow.allowed(target) {
			sc.denied.Inc()
			sc.log.Error("SSRF protection: prefill target not in allowlist", "target", target, "path", r.URL.Path)
			http.Error(w, "Forbidden: prefill target not allowed by SSRF protection", http.StatusForbidden)
			return
		}
		if r.URL.Path == pathGenerate {
			sc.onceGen.Do(func() {
				sc.log.Warn("sidecar: /inference/v1/generate is served on the local engine without a prefill leg (bidikv routes the chat, completions, responses and messages APIs); counted in bidikv_sidecar_local_turns_total{reason=\"generate\"}")
			})
			plain(rank, "generate").ServeHTTP(w, r)
			return
		}
		purl, err := sc.pools.learn(target)
		if err != nil {
			writeError(w, r, http.StatusBadRequest, "x-prefiller-host-port "+strconv.Quote(target)+": "+err.Error())
			return
		}
		u, _ := url.Parse(purl)
		rt := &legs{prefill: purl, decode: sc.locals[rank], prefillHost: u.Host}
		rt.cached.Store(-1)
		cw, finish := newCachedWriter(w, rt, r.URL.Path)
		routed.ServeHTTP(cw, r.WithContext(withRoute(r.Context(), rt)))
		finish()
	}
}

// dpRank is the rank whose sidecar listener x-data-parallel-host-port
// names (POD_IP:port+rank), as llm-d's data-parallel handler.
func (sc *sidecar) dpRank(hostPort string) (int, bool) {
	for r := range sc.cfg.dpSize {
		p := strconv.Itoa(sc.cfg.port + r)
		if hostPort == net.JoinHostPort(sc.cfg.localHost, p) || hostPort == net.JoinHostPort(sc.cfg.podIP, p) {
			return r, true
		}
	}
	return 0, false
}

// handler is the listener of rank's routes: the APIs, GET /health, GET
// /metrics (the local engine's, with the sidecar's figures added), and
// the local engine for every other path.
func (sc *sidecar) handler(rank int) http.Handler {
	s := sc.st.server
	routed := s.auth(s.admit(sc.st.router))
	plain := func(rk int, reason string) http.Handler {
		return s.auth(s.admit(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			sc.localTurns.WithLabelValues(r.URL.Path, reason).Inc()
			sc.local(w, r, rk)
		})))
	}
	mux := http.NewServeMux()
	turn := sc.turn(rank, routed, plain)
	for _, p := range []string{kvroute.PathChatCompletions, kvroute.PathCompletions, kvroute.PathResponses, kvroute.PathMessages, pathGenerate} {
		mux.Handle("POST "+p, turn)
	}
	mux.HandleFunc("GET /health", func(w http.ResponseWriter, _ *http.Request) { w.WriteHeader(http.StatusOK) })
	mux.Handle("GET /metrics", sc.metricsHandler(rank))
	mux.Handle("/", sc.passThrough(rank))
	return s.access(s.headerLimit(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Body != nil && r.Body != http.NoBody {
			// As the proxy's routes: a turn lifts it once its body is in.
			_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(s.readBodyTimeout))
		}
		if s.ambiguousLength(w, r) {
			return
		}
		mux.ServeHTTP(w, r)
	})))
}

// serve listens on --port+rank for each rank (TLS with --secure-proxy)
// and on --metrics-port, until ctx ends, then drains every listener.
func (sc *sidecar) serve(ctx context.Context, stdout io.Writer) error {
	var tlsCfg *tls.Config
	if sc.cfg.secure {
		var err error
		if tlsCfg, err = sc.cfg.serverTLS(time.Now); err != nil {
			return err
		}
	}
	type listener struct {
		srv    *http.Server
		served chan error
	}
	var ls []listener
	defer sc.st.server.open.close()
	defer sc.st.poll()()
	start := func(addr string, h http.Handler, admit bool, what string) error {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		srv := sc.st.httpServer(h)
		l := listener{srv: srv, served: make(chan error, 1)}
		var nl net.Listener = ln
		if admit {
			nl = newAdmitListener(ln, sc.st.server.adm)
		}
		if tlsCfg != nil && admit {
			nl = tls.NewListener(nl, tlsCfg)
		}
		go func() { l.served <- srv.Serve(nl) }()
		ls = append(ls, l)
		scheme := "http"
		if tlsCfg != nil && admit {
			scheme = "https"
		}
		fmt.Fprintf(stdout, "sidecar: serving %s://%s %s\n", scheme, ln.Addr(), what)
		return nil
	}
	var err error
	for r := range sc.cfg.dpSize {
		port := sc.cfg.port
		if port != 0 {
			port += r
		}
		if err = start(net.JoinHostPort(sc.cfg.host, strconv.Itoa(port)), sc.handler(r), true, "decode "+sc.locals[r]); err != nil {
			break
		}
	}
	if err == nil && sc.cfg.metricsPort > 0 {
		err = start(net.JoinHostPort(sc.cfg.host, strconv.Itoa(sc.cfg.metricsPort)), sc.st.metrics.handler(), false, "metrics")
	}
	if err == nil {
		sc.log.Info("sidecar serving", slog.Any("decode", sc.locals), slog.Bool("redis", sc.cfg.redisURL != ""),
			slog.Bool("tls", tlsCfg != nil), slog.Bool("ssrf_protection", sc.cfg.ssrf))
		<-ctx.Done()
	}
	var errs []error
	for _, l := range ls {
		if derr := drain(l.srv, l.served, sc.st.server.open, sc.cfg.shutdownGrace, sc.log); derr != nil {
			errs = append(errs, derr)
		}
	}
	return errors.Join(append([]error{err}, errs...)...)
}

// metricsHandler serves GET /metrics of rank's listener: the local
// engine's own exposition, as llm-d's sidecar passes it through (the
// endpoint picker scrapes the pod there), followed by the sidecar's
// registry in Prometheus' text format (every name starts with bidikv_),
// so that the picker's metrics extractor reads both in one scrape. When
// the engine cannot be read, the sidecar's figures alone are served.
func (sc *sidecar) metricsHandler(rank int) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		var engine []byte
		req, err := http.NewRequestWithContext(r.Context(), http.MethodGet, sc.locals[rank]+"/metrics", nil)
		if err == nil {
			req.Header.Set("Accept", "text/plain; version=0.0.4")
			if sc.upstream != "" {
				req.Header.Set("Authorization", "Bearer "+sc.upstream)
			}
			resp, err := sc.engines.Do(req, transport.Deadlines{FirstByte: sc.cfg.healthTimeout, Idle: sc.cfg.healthTimeout})
			if err == nil {
				if resp.StatusCode == http.StatusOK && resp.Header.Get("Content-Encoding") == "" {
					engine, _ = readLimitedBody(resp.Body, maxEngineMetrics)
				}
				_ = resp.Body.Close()
			}
		}
		mfs, err := sc.st.metrics.reg.Gather()
		if err != nil {
			writeError(w, r, http.StatusInternalServerError, "gathering the sidecar's metrics: "+err.Error())
			return
		}
		w.Header().Set("Content-Type", string(expfmt.NewFormat(expfmt.TypeTextPlain)))
		_, _ = w.Write(engine)
		if len(engine) > 0 && engine[len(engine)-1] != '\n' {
			_, _ = io.WriteString(w, "\n")
		}
		enc := expfmt.NewEncoder(w, expfmt.NewFormat(expfmt.TypeTextPlain))
		for _, mf := range mfs {
			if err := enc.Encode(mf); err != nil {
				return
			}
		}
	})
}

// maxEngineMetrics bounds the local engine's /metrics the sidecar copies.
const maxEngineMetrics = 16 << 20
