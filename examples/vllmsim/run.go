package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strconv"
	"time"

	"github.com/bidikv/bidikv/internal/sim"
)

// run serves until ctx is done.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stdout)
	if err != nil {
		return err
	}
	for _, w := range o.warnings {
		fmt.Fprintln(stderr, "vllmsim: warning:", w)
	}
	apiLn, err := net.Listen("tcp", net.JoinHostPort(o.host, strconv.Itoa(o.port)))
	if err != nil {
		return err
	}
	defer apiLn.Close()
	if o.canned != "" {
		return runCanned(ctx, o, apiLn, stdout)
	}
	sideLns, err := listenRun(o.sideHost, o.sidePort, o.cfg.DPSize)
	if err != nil {
		return err
	}
	defer func() {
		for _, ln := range sideLns {
			_ = ln.Close()
		}
	}()

	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConnsPerHost = 64
	reg := sim.NewRegistry()
	reg.Dial = sim.HTTPDialer(&http.Client{Transport: transport})
	o.cfg.Registry = reg
	o.cfg.SideHost, o.cfg.SidePort = o.sideHost, sideLns[0].Addr().(*net.TCPAddr).Port
	if o.cfg.CPUTier.HashSeed == "" {
		o.cfg.CPUTier.HashSeed = os.Getenv("PYTHONHASHSEED")
	}
	var p2pLns []net.Listener
	if o.cfg.CPUTier.P2P {
		// the peer tier's port run (VLLM_P2P_SIDE_CHANNEL_PORT + rank)
		if p2pLns, err = listenRun(o.sideHost, o.cfg.CPUTier.P2PPort, o.cfg.DPSize); err != nil {
			return err
		}
		defer func() {
			for _, ln := range p2pLns {
				_ = ln.Close()
			}
		}()
		o.cfg.CPUTier.P2PPort = p2pLns[0].Addr().(*net.TCPAddr).Port
	}
	if o.verbose {
		o.cfg.Logger = slog.New(slog.NewTextHandler(stderr, nil))
	}
	e, err := sim.New(o.cfg)
	if err != nil {
		return err
	}
	defer e.Close()

	api := &http.Server{Handler: e, ReadHeaderTimeout: 30 * time.Second}
	sides := make([]*http.Server, len(sideLns))
	errc := make(chan error, 1+len(sideLns)+len(p2pLns))
	go func() { errc <- api.Serve(apiLn) }()
	for k, ln := range sideLns {
		sides[k] = &http.Server{Handler: sim.RankSideChannelHandler(e, k), ReadHeaderTimeout: 30 * time.Second}
		go func() { errc <- sides[k].Serve(ln) }()
	}
	for k, ln := range p2pLns {
		srv := &http.Server{Handler: sim.RankP2PHandler(e, k), ReadHeaderTimeout: 30 * time.Second}
		sides = append(sides, srv)
		go func() { errc <- srv.Serve(ln) }()
	}
	dp := ""
	if n := e.DPSize(); n > 1 {
		dp = fmt.Sprintf(" data-parallel %d side ports %d-%d", n, o.cfg.SidePort, o.cfg.SidePort+n-1)
	}
	if host, port, ok := e.RankP2PAddr(0); ok {
		dp += " p2p " + net.JoinHostPort(host, strconv.Itoa(port))
	}
	fmt.Fprintf(stdout, "vllmsim: serving http://%s side channel %s engine %s%s\n",
		apiLn.Addr(), net.JoinHostPort(o.cfg.SideHost, strconv.Itoa(o.cfg.SidePort)), e.EngineID(), dp)

	err = serveUntil(ctx, errc, append([]*http.Server{api}, sides...)...)
	transport.CloseIdleConnections()
	return err
}

// serveUntil waits until ctx is done or a server's Serve (reporting on
// errc) fails, then shuts the servers down, allowing 5 s; it returns the
// Serve error, nil when the servers only closed.
func serveUntil(ctx context.Context, errc <-chan error, servers ...*http.Server) error {
	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, srv := range servers {
		_ = srv.Shutdown(shutdown)
	}
	if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
		return serveErr
	}
	return nil
}

// listenRun listens on n consecutive ports from port on host, one per
// data-parallel rank. Port 0 takes any free run: the first port from the
// system, the next ones after it, retried a few times when one is taken.
func listenRun(host string, port, n int) ([]net.Listener, error) {
	n = max(n, 1)
	var lastErr error
	for range 20 {
		first, err := net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(port)))
		if err != nil {
			return nil, err
		}
		lns := []net.Listener{first}
		base := first.Addr().(*net.TCPAddr).Port
		for k := 1; k < n && err == nil; k++ {
			var ln net.Listener
			if ln, err = net.Listen("tcp", net.JoinHostPort(host, strconv.Itoa(base+k))); err == nil {
				lns = append(lns, ln)
			}
		}
		if err == nil {
			return lns, nil
		}
		for _, ln := range lns {
			_ = ln.Close()
		}
		if port != 0 {
			return nil, err
		}
		lastErr = err
	}
	return nil, lastErr
}

// runCanned serves the canned engine (canned.go) until ctx is done.
func runCanned(ctx context.Context, o *options, ln net.Listener, stdout io.Writer) error {
	h, err := cannedHandler(o.canned, o.cfg.Model, cannedKV{blockSize: o.cfg.BlockSize, groups: o.cfg.KVGroups, poolBlocks: o.cannedBlocks})
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 30 * time.Second}
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	fmt.Fprintf(stdout, "vllmsim: serving http://%s canned %s\n", ln.Addr(), o.canned)
	return serveUntil(ctx, errc, srv)
}
