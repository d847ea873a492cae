package main

import (
	"context"
	"io"
	"log/slog"
	"net/http"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/transport"
)

// stack is what serves turns, built from a configuration: the tracing, the
// store, the upstream transport, the metrics, the admission, the router,
// the engines' health checks and the server's routes. The proxy (run) and
// the llm-d sidecar (runSidecar) build one each and differ only in their
// listeners, routes and hooks.
type stack struct {
	cfg     *config
	log     *slog.Logger
	router  *kvroute.Router
	health  *health
	metrics *metrics
	server  *server
	client  *http.Client // the engines' transport, for the proxy's own calls
	rt      http.RoundTripper
	closers []func() // in the order close runs them
}

// stackHooks are what the sidecar changes in a stack.
type stackHooks struct {
	// transport are options of the shared upstream transport (its TLS).
	transport []transport.Option
	// wrap, when not nil, wraps the shared transport for the router and
	// the proxy's own engine calls.
	wrap func(http.RoundTripper) http.RoundTripper
	// options are router options applied after the configuration's.
	options []kvroute.Option
}

// newStack builds the stack of cfg. The caller closes it (close) after the
// drain.
func newStack(ctx context.Context, cfg *config, getenv func(string) string, stdout io.Writer, log *slog.Logger, hooks stackHooks) (_ *stack, err error) {
	st := &stack{cfg: cfg, log: log}
	defer func() {
		if err != nil {
			st.close()
		}
	}()
	tel, err := newTelemetry(getenv, stdout, log) // OpenTelemetry, from OTEL_* (otel.go)
	if err != nil {
		return nil, err
	}
	st.closers = append(st.closers, func() { tel.shutdown(log) }) // after the drain: flushes the last turns' spans

	store, closeStore, err := newStore(cfg, log)
	if err != nil {
		return nil, err
	}
	st.closers = append([]func(){closeStore}, st.closers...)
	cfg.memory.shared = cfg.memory.journalOf(store)

	tr, err := transport.NewTransport(hooks.transport...)
	if err != nil {
		return nil, err
	}
	st.closers = append([]func(){tr.CloseIdleConnections}, st.closers...)
	st.rt = tr
	if hooks.wrap != nil {
		st.rt = hooks.wrap(tr)
	}
	st.client = &http.Client{Transport: st.rt}

	m := newMetrics()
	m.watchStore(store)
	adm := newAdmission(limits{conns: cfg.maxConns, transit: cfg.maxTransit, clientTransit: cfg.maxClientTransit,
		turns: cfg.maxTurns, bytes: cfg.maxBufferedBytes, minBodyRate: cfg.minBodyRate}, nil)
	cfg.chargeAnswer = adm.chargeAnswer
	obs := kvroute.ObserverFunc(func(rec *kvroute.TurnRecord) {
		m.observe(rec)
		logTurn(ctx, log, rec)
	})
	opts := append(cfg.routerOptions(),
		kvroute.WithStore(store), kvroute.WithObserver(obs), kvroute.WithTransport(st.rt),
		kvroute.WithLogger(log.With(slog.String("component", "kvroute"))))
	opts = append(opts, tel.options()...)
	opts = append(opts, hooks.options...)
	router, err := kvroute.New(opts...)
	if err != nil {
		return nil, flagError(err)
	}
	st.router = router
	st.closers = append([]func(){func() { _ = router.Close() }}, st.closers...)
	m.watchRouter(router)
	m.watchMemory(router, cfg.memory.ledger, cfg.retentionTTL, cfg.memory.shared != nil)

	h := newHealth(st.client, cfg.prefillURLs, cfg.decodeURLs, cfg.healthTimeout, log)
	h.onChange = m.setUp
	if cfg.upstreamAPIKey != "" {
		h.capOpts = append(h.capOpts, capability.WithAPIKey(cfg.upstreamAPIKey))
	}
	h.onCaps = cfg.warnGaps(ctx, log)
	h.status = routerStatus(router)
	m.watchEngines(h)
	st.health, st.metrics = h, m

	s := &server{
		router: router, health: h, metrics: m, client: st.client, upstream: cfg.upstreamAPIKey, log: log,
		maxHeaderBytes: cfg.maxHeaderBytes, maxBodyBytes: cfg.maxBodyBytes, readBodyTimeout: cfg.readBodyTimeout,
		writeTimeout: cfg.writeTimeout, metricsKey: cfg.metricsKey,
		adm: adm, open: newOpenTurns(),
	}
	m.watchAdmission(s.adm)
	for _, k := range cfg.apiKeys {
		s.keys = append(s.keys, newInboundKey(k))
	}
	st.server = s
	return st, nil
}

// httpServer returns the HTTP server of handler, with the stack's bounds.
// It has no ReadTimeout or WriteTimeout: they would cut long streams. The
// body has its own deadline (--read-body-timeout, set per request).
func (st *stack) httpServer(handler http.Handler) *http.Server {
	s := st.server
	return &http.Server{
		Handler:           handler,
		ReadHeaderTimeout: st.cfg.readHeaderTimeout,
		IdleTimeout:       st.cfg.idleConnTimeout,
		MaxHeaderBytes:    st.cfg.maxHeaderBytes,
		ErrorLog:          slog.NewLogLogger(st.log.Handler(), slog.LevelWarn),
		BaseContext:       s.open.baseContext, // the drain cuts turns through it
		ConnContext:       connContext,        // requests find their connection (admit.go)
		ConnState:         s.adm.connState,    // the admission learns which connections wait
	}
}

// poll starts the engines' health loop and returns the function that stops
// it and waits for it.
func (st *stack) poll() func() {
	pollCtx, stopPoll := context.WithCancel(context.Background())
	polled := make(chan struct{})
	go func() {
		defer close(polled)
		st.health.run(pollCtx, st.cfg.healthInterval)
	}()
	return func() { stopPoll(); <-polled }
}

// close releases what newStack built, the router first and the tracing
// last (it flushes the last turns' spans).
func (st *stack) close() {
	for _, c := range st.closers {
		c()
	}
	st.closers = nil
}
