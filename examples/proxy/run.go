package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/redis/go-redis/v9"

	"github.com/bidikv/bidikv/internal/turnfields"
	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/retention"
	"github.com/bidikv/bidikv/retention/redisstore"
)

// run serves until ctx is done, then drains: the listener closes at once,
// requests in flight get up to --shutdown-grace to finish, and whatever is
// left is then cut.
func run(ctx context.Context, args []string, getenv func(string) string, stdout, stderr io.Writer) error {
	if len(args) > 0 {
		switch args[0] {
		case "doctor":
			if slices.ContainsFunc(args[1:], func(a string) bool { return a == "--sidecar" || a == "-sidecar" || a == "--sidecar=true" }) {
				return runSidecarDoctor(ctx, args[1:], getenv, stdout)
			}
			return runDoctor(ctx, args[1:], getenv, stdout, stderr)
		case "sidecar":
			return runSidecar(ctx, args[1:], getenv, stdout, stderr)
		}
	}
	cfg, err := parseConfig(args, getenv, stdout)
	if err != nil {
		return err
	}
	log := newLogger(cfg, stderr)
	for _, w := range cfg.warnings {
		log.Warn(w)
	}
	if err := resolveDNS(ctx, cfg, nil, log); err != nil {
		return err
	}
	st, err := newStack(ctx, cfg, getenv, stdout, log, stackHooks{})
	if err != nil {
		return err
	}
	defer st.close()
	waitDNS, err := watchDNS(ctx, cfg, nil, st.router.SetEndpoints, st.health, st.metrics, log)
	if err != nil {
		return err
	}
	defer waitDNS()
	s := st.server

	if cfg.debugAddr != "" {
		stopDebug, err := serveDebug(cfg.debugAddr, cfg.debugRemote, stdout, log)
		if err != nil {
			return err
		}
		defer stopDebug()
	}

	ln, err := net.Listen("tcp", net.JoinHostPort(cfg.host, strconv.Itoa(cfg.port)))
	if err != nil {
		return err
	}
	srv := st.httpServer(s.routes())
	defer s.open.close()
	defer st.poll()()

	served := make(chan error, 1)
	go func() { served <- srv.Serve(newAdmitListener(ln, s.adm)) }()
	fmt.Fprintf(stdout, "proxy: serving http://%s prefill %v decode %v\n", ln.Addr(), cfg.prefillURLs, cfg.decodeURLs)
	log.Info("serving", slog.String("addr", ln.Addr().String()),
		slog.Any("prefill", cfg.prefillURLs), slog.Any("decode", cfg.decodeURLs),
		slog.Bool("reuse", cfg.reuse), slog.String("key_mode", cfg.keyMode),
		slog.Bool("redis", cfg.redisURL != ""), slog.Int("inbound_keys", len(cfg.apiKeys)),
		slog.Int("max_concurrent_turns", cfg.maxTurns), slog.Int64("max_buffered_bytes", cfg.maxBufferedBytes),
		slog.Int("max_connections", cfg.maxConns), slog.Int("max_bodies_in_transit", cfg.maxTransit))

	if cfg.keyMode == keyConversationID && len(cfg.apiKeys) == 0 {
		log.Warn("--key-mode conversation-id without inbound API keys (--allow-anonymous-conversation-id): every client is one tenant")
	}

	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	return drain(srv, served, s.open, cfg.shutdownGrace, log)
}

// warnGaps returns the health loop's onCaps: it logs each gap between the
// configuration and the engines found once (capabilities.go), as a warning
// (an error when reuse cannot work at all; a note at info level).
func (c *config) warnGaps(ctx context.Context, log *slog.Logger) func([]engineFacts) {
	logged := map[gap]bool{}
	return func(engines []engineFacts) {
		for _, g := range c.gaps(engines) {
			if logged[g] {
				continue
			}
			logged[g] = true
			level := slog.LevelWarn
			switch g.severity {
			case gapError:
				level = slog.LevelError
			case gapNote:
				level = slog.LevelInfo
			}
			log.LogAttrs(ctx, level, "engines: "+g.what, slog.String("fix", g.fix))
		}
	}
}

// newStore returns Redis when --redis-url is set, else an in-memory store.
func newStore(cfg *config, log *slog.Logger) (kvroute.Store, func(), error) {
	switch {
	case cfg.redisWaitReplicas < 0:
		return nil, nil, fmt.Errorf("%w: --redis-wait-replicas must not be negative", errUsage)
	case cfg.redisWaitReplicas > 0 && cfg.redisURL == "":
		return nil, nil, fmt.Errorf("%w: --redis-wait-replicas needs --redis-url", errUsage)
	}
	if cfg.redisURL != "" {
		// go-redis's own lines (a failed dial per call while Redis is
		// down) through the process logger, not as text on stderr.
		redis.SetLogger(redisstore.NewGoRedisLog(log.With(slog.String("component", "go-redis"))))
		rs, err := redisstore.NewFromURL(cfg.redisURL, redisstore.WithLogger(log.With(slog.String("component", "redisstore"))),
			redisstore.WithWaitReplicas(cfg.redisWaitReplicas))
		if err != nil {
			return nil, nil, fmt.Errorf("%w: --redis-url: %v", errUsage, err)
		}
		return rs, func() { _ = rs.Close() }, nil
	}
	mem, err := retention.NewMemory()
	if err != nil {
		return nil, nil, err
	}
	return mem, func() { _ = mem.Close() }, nil
}

// newLogger builds the process logger from --log-level and --log-format.
func newLogger(cfg *config, w io.Writer) *slog.Logger {
	ho := &slog.HandlerOptions{Level: cfg.logLevel}
	if cfg.logFormat == "json" {
		return slog.New(slog.NewJSONHandler(w, ho))
	}
	return slog.New(slog.NewTextHandler(w, ho))
}

// logTurn logs one turn at debug level (warn when it failed on the
// proxy's or an engine's side; a client's error, such as a malformed
// request, stays at debug: clients must not be able to flood the log),
// with ids and timings only: never prompts, bodies or credentials. The
// attributes are the record's fields as their turn tags declare them.
func logTurn(ctx context.Context, log *slog.Logger, rec *kvroute.TurnRecord) {
	level := slog.LevelDebug
	if rec.Err != nil && kvroute.HTTPStatus(rec.Err) >= 500 {
		level = slog.LevelWarn
	}
	if !log.Enabled(ctx, level) {
		return
	}
	log.LogAttrs(ctx, level, "turn", turnFields.Attrs(make([]slog.Attr, 0, 40), rec)...)
}

// turnFields is the shown fields of kvroute.TurnRecord, read once from
// its tags (an immutable table, as a compiled pattern would be).
var turnFields = mustTurnFields()

func mustTurnFields() *turnfields.Table {
	tb, err := turnfields.For(reflect.TypeFor[kvroute.TurnRecord]())
	if err != nil {
		panic(err) // a tag of kvroute's own: TestTurnFieldsShown fails first
	}
	return tb
}

// routerStatus returns the health loop's status: the router's view of the
// engine at url in role (the first of its data-parallel ranks), nil when
// it routes to none there.
func routerStatus(r *kvroute.Router) func(role, url string) *kvroute.EndpointStatus {
	return func(role, url string) *kvroute.EndpointStatus {
		phase := kvroute.PhaseDecode
		if role == rolePrefill {
			phase = kvroute.PhasePrefill
		}
		for _, st := range r.Endpoints(phase) {
			base, _, _ := strings.Cut(st.URL, " (rank ")
			if strings.TrimRight(base, "/") == url {
				return &st
			}
		}
		return nil
	}
}
