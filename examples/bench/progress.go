package main

import (
	"fmt"
	"io"
	"time"

	"github.com/bidikv/bidikv/internal/cli"
)

// progressInterval is how often a long run prints a progress line.
const progressInterval = 10 * time.Second

// progressOut is where a run's progress lines go: w when it is a
// terminal, else nowhere, so that a redirected run's output holds its
// results and errors only.
func progressOut(w io.Writer) io.Writer {
	if cli.IsTerminal(w) {
		return w
	}
	return io.Discard
}

// every prints line() to w once per interval until the returned stop is
// called; nothing when w is io.Discard (progressOut's answer off a
// terminal).
func every(w io.Writer, interval time.Duration, line func() string) (stop func()) {
	if w == io.Discard {
		return func() {}
	}
	done, finished := make(chan struct{}), make(chan struct{})
	go func() {
		defer close(finished)
		t := time.NewTicker(interval)
		defer t.Stop()
		for {
			select {
			case <-done:
				return
			case <-t.C:
				fmt.Fprintln(w, line())
			}
		}
	}()
	return func() {
		close(done)
		<-finished
	}
}
