package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
	"github.com/stretchr/testify/require"
)

// server is a redis-server child process on a free 127.0.0.1 port, with
// persistence off, stopped when the test ends.
type server struct {
	t     testing.TB
	port  int
	dir   string
	pre   []string // arguments before the server's own (a config file)
	extra []string
	cmd   *exec.Cmd
	exit  chan struct{} // closed when cmd has exited
}

// startServer starts redis-server with extra arguments. Without the binary
// the test is skipped, except in CI (CI=true), where it fails.
func startServer(t testing.TB, extra ...string) *server {
	t.Helper()
	needRedis(t)
	return launch(t, &server{t: t, dir: t.TempDir(), extra: extra})
}

// needRedis skips the test when redis-server is not installed, except in CI
// (CI=true), where it fails.
func needRedis(t testing.TB) {
	t.Helper()
	if _, err := exec.LookPath("redis-server"); err != nil {
		if os.Getenv("CI") == "true" {
			t.Fatalf("redis-server not installed: %v", err)
		}
		t.Skipf("redis-server not installed: %v", err)
	}
}

// launch starts s, on a free port, and kills it when the test ends.
func launch(t testing.TB, s *server) *server {
	t.Helper()
	// The free port may be taken between Close and redis-server's bind:
	// try a few.
	var err error
	for range 5 {
		s.port = freePort(t)
		if err = s.start(); err == nil {
			break
		}
	}
	require.NoError(t, err, "start redis-server")
	t.Cleanup(s.kill)
	return s
}

func freePort(t testing.TB) int {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// Addr is the server's host:port.
func (s *server) Addr() string { return net.JoinHostPort("127.0.0.1", strconv.Itoa(s.port)) }

// URL is the server's redis:// URL.
func (s *server) URL() string { return "redis://" + s.Addr() + "/0" }

// start runs redis-server on s.port and waits until it answers PING.
func (s *server) start() error {
	args := append(append(append([]string(nil), s.pre...),
		"--port", strconv.Itoa(s.port), "--bind", "127.0.0.1",
		"--save", "", "--appendonly", "no", "--dir", s.dir, "--logfile", "",
	), s.extra...)
	cmd := exec.Command("redis-server", args...)
	if err := cmd.Start(); err != nil {
		return err
	}
	exit := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exit) }()
	s.cmd, s.exit = cmd, exit

	c := redis.NewClient(&redis.Options{Addr: s.Addr(), MaxRetries: -1, DialTimeout: 100 * time.Millisecond})
	defer c.Close()
	tick := time.NewTicker(10 * time.Millisecond)
	defer tick.Stop()
	for range 500 { // about 5 s
		ctx, cancel := context.WithTimeout(context.Background(), 100*time.Millisecond)
		err := c.Ping(ctx).Err()
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-exit:
			return fmt.Errorf("redis-server on port %d exited: %v", s.port, cmd.ProcessState)
		case <-tick.C:
		}
	}
	s.kill()
	return errors.New("redis-server did not answer PING")
}

// kill stops the server at once (SIGKILL) and waits for it to exit.
func (s *server) kill() {
	if s.cmd == nil {
		return
	}
	_ = s.cmd.Process.Signal(syscall.SIGCONT) // in case it was paused
	_ = s.cmd.Process.Kill()
	<-s.exit
	s.cmd = nil
}

// restart starts a fresh, empty server on the same port.
func (s *server) restart() {
	s.t.Helper()
	s.kill()
	require.NoError(s.t, s.start(), "restart redis-server")
}

// pause freezes the server (SIGSTOP): connections open and commands are
// accepted by the kernel, but nothing answers. The returned func resumes it.
func (s *server) pause() (resume func()) {
	s.t.Helper()
	require.NoError(s.t, s.cmd.Process.Signal(syscall.SIGSTOP))
	return func() { _ = s.cmd.Process.Signal(syscall.SIGCONT) }
}

// client returns a go-redis client for the server that honours context
// deadlines, closed when the test ends.
func (s *server) client(t testing.TB) *redis.Client {
	c := redis.NewClient(&redis.Options{Addr: s.Addr(), ContextTimeoutEnabled: true})
	t.Cleanup(func() { _ = c.Close() })
	return c
}
