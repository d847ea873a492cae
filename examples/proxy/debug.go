package main

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"net/http/pprof"
	"time"
)

// serveDebug serves Go's profiler on addr (--debug-addr), on a listener
// and mux of its own so that nothing of it is reachable through the
// proxy's port. It returns a function that closes it.
//
// The profiler has no authentication, so addr must be a loopback address
// (127.0.0.1:6060, [::1]:6060, localhost:6060) unless remote is set
// (--debug-allow-remote), which is then warned about; ":6060" (every
// interface) is refused. /debug/pprof/cmdline is not served: the command
// line may hold secrets (--api-key, --redis-url's password).
func serveDebug(addr string, remote bool, stdout io.Writer, log *slog.Logger) (func(), error) {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return nil, fmt.Errorf("%w: --debug-addr %q: %v", errUsage, addr, err)
	}
	if ip := net.ParseIP(host); !remote && (host == "" || ip != nil && !ip.IsLoopback()) {
		return nil, errDebugRemote(addr)
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("%w: --debug-addr %q: %v", errUsage, addr, err)
	}
	if ta, ok := ln.Addr().(*net.TCPAddr); ok && !ta.IP.IsLoopback() {
		if !remote {
			_ = ln.Close()
			return nil, errDebugRemote(addr)
		}
		log.Warn("--debug-addr listens on a non-loopback address: anyone who reaches it can profile the process (--debug-allow-remote)",
			slog.String("addr", ln.Addr().String()))
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/debug/pprof/", pprof.Index)
	mux.HandleFunc("/debug/pprof/cmdline", func(w http.ResponseWriter, _ *http.Request) {
		http.Error(w, "not served: the command line may hold secrets", http.StatusNotFound)
	})
	mux.HandleFunc("/debug/pprof/profile", pprof.Profile)
	mux.HandleFunc("/debug/pprof/symbol", pprof.Symbol)
	mux.HandleFunc("/debug/pprof/trace", pprof.Trace)
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); err != nil && !errors.Is(err, http.ErrServerClosed) {
			fmt.Fprintf(stdout, "proxy: debug listener: %v\n", err)
		}
	}()
	fmt.Fprintf(stdout, "proxy: profiler on http://%s/debug/pprof/\n", ln.Addr())
	return func() { _ = srv.Close(); <-done }, nil
}

func errDebugRemote(addr string) error {
	return fmt.Errorf("%w: --debug-addr %q is not a loopback address: the profiler has no authentication, "+
		"so give 127.0.0.1:PORT (or [::1]:PORT, localhost:PORT), or add --debug-allow-remote to accept that anyone who reaches it can profile the process", errUsage, addr)
}
