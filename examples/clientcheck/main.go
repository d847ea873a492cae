// Command clientcheck checks a real client's turns through bidikv: it
// stands between the client and the proxy, forwards every request, and
// sends each generation request (chat, completions, Responses, Messages)
// again, byte for byte, to a plain engine that serves it alone. The
// proxy's answer must be the plain engine's: the same text, the same tool
// calls (name and arguments) and the same finish. One line per request
// says what the request ended with (a user's text or a tool's result),
// how the reply ended, the proxy's X-Bidikv-Reuse, and whether the two
// answers agree; the summary goes to stderr when it stops (Ctrl-C).
//
//	go run ./examples/clientcheck -listen 127.0.0.1:18310 -proxy http://127.0.0.1:18300 -plain http://127.0.0.1:18303
//
// Point the client at -listen (ANTHROPIC_BASE_URL, a Codex provider's
// base_url). The plain engine must be of the same model and sampling (for
// the simulated engines: another vllmsim with no KV transfer config).
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
)

func main() {
	listen := flag.String("listen", "127.0.0.1:18310", "address the client connects to")
	proxy := flag.String("proxy", "http://127.0.0.1:18300", "the bidikv proxy's base URL")
	plain := flag.String("plain", "http://127.0.0.1:18303", "a plain engine's base URL (the reference)")
	flag.Parse()
	c, err := newChecker(*proxy, *plain, os.Stdout)
	if err != nil {
		fmt.Fprintln(os.Stderr, "clientcheck:", err)
		os.Exit(2)
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fmt.Fprintln(os.Stderr, "clientcheck:", err)
		os.Exit(1)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	srv := &http.Server{Handler: c}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	fmt.Fprintf(os.Stderr, "clientcheck: listening on http://%s\n", ln.Addr())
	if err := srv.Serve(ln); err != nil && err != http.ErrServerClosed {
		log.Fatal(err)
	}
	s := c.summary()
	fmt.Fprintln(os.Stderr, s)
	if c.differ.Load() > 0 {
		os.Exit(1)
	}
}
