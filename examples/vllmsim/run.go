package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/bidikv/bidikv/internal/sim"
)

// run serves until ctx is done.
func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseFlags(args, stderr)
	if err != nil {
		return err
	}
	apiLn, err := net.Listen("tcp", net.JoinHostPort(o.host, strconv.Itoa(o.port)))
	if err != nil {
		return err
	}
	defer apiLn.Close()
	sideLn, err := net.Listen("tcp", net.JoinHostPort(o.sideHost, strconv.Itoa(o.sidePort)))
	if err != nil {
		return err
	}
	defer sideLn.Close()

	transport := http.DefaultTransport.(*http.Transport).Clone()
	transport.MaxIdleConnsPerHost = 64
	reg := sim.NewRegistry()
	reg.Dial = sim.HTTPDialer(&http.Client{Transport: transport})
	o.cfg.Registry = reg
	o.cfg.SideHost, o.cfg.SidePort = o.sideHost, sideLn.Addr().(*net.TCPAddr).Port
	if o.verbose {
		o.cfg.Logger = slog.New(slog.NewTextHandler(stderr, nil))
	}
	e, err := sim.New(o.cfg)
	if err != nil {
		return err
	}
	defer e.Close()

	api := &http.Server{Handler: e, ReadHeaderTimeout: 30 * time.Second}
	side := &http.Server{Handler: sim.SideChannelHandler(e), ReadHeaderTimeout: 30 * time.Second}
	errc := make(chan error, 2)
	go func() { errc <- api.Serve(apiLn) }()
	go func() { errc <- side.Serve(sideLn) }()
	fmt.Fprintf(stdout, "vllmsim: serving http://%s side channel %s engine %s\n",
		apiLn.Addr(), net.JoinHostPort(o.cfg.SideHost, strconv.Itoa(o.cfg.SidePort)), e.EngineID())

	var serveErr error
	select {
	case <-ctx.Done():
	case serveErr = <-errc:
	}
	shutdown, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = api.Shutdown(shutdown)
	_ = side.Shutdown(shutdown)
	transport.CloseIdleConnections()
	if serveErr != nil && !errors.Is(serveErr, http.ErrServerClosed) {
		return serveErr
	}
	return nil
}
