package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"sync"
	"time"
)

// errCut is the cause given to the contexts of turns still open when the
// shutdown grace period ends.
var errCut = errors.New("proxy: cut at the end of the shutdown grace period")

// cutWait bounds how long the drain waits, after cutting the open turns,
// for their error events to go out before it closes every connection.
const cutWait = 2 * time.Second

// openTurns counts the turns being served, for the drain to cut, and
// holds the context every connection's requests derive from
// (http.Server.BaseContext): cutting cancels it, so no turn needs a
// cancellable context of its own.
type openTurns struct {
	mu     sync.Mutex
	n      int
	base   context.Context
	cancel context.CancelCauseFunc
}

func newOpenTurns() *openTurns {
	ctx, cancel := context.WithCancelCause(context.Background())
	return &openTurns{base: ctx, cancel: cancel}
}

// baseContext is the server's BaseContext.
func (o *openTurns) baseContext(net.Listener) context.Context { return o.base }

// add registers a turn until remove.
func (o *openTurns) add() {
	o.mu.Lock()
	o.n++
	o.mu.Unlock()
}

func (o *openTurns) remove() {
	o.mu.Lock()
	o.n--
	o.mu.Unlock()
}

// cut cancels, when any turn is open, the context of every request still
// in flight with errCut, so that each open turn ends with an error event
// (a stream) or 503 (no byte sent yet); other requests still open then
// (the server is about to close their connections) end too. It reports
// how many turns it cut.
func (o *openTurns) cut() int {
	o.mu.Lock()
	n := o.n
	o.mu.Unlock()
	if n > 0 {
		o.cancel(errCut)
	}
	return n
}

// close releases the base context once the server is done.
func (o *openTurns) close() { o.cancel(nil) }

// errDrainCut is returned by run when the grace period ended with turns
// still open: the process exits non-zero.
var errDrainCut = errors.New("proxy: shutdown grace period over with turns in flight")

// drain stops accepting and lets requests in flight finish within the
// grace period; turns still open then are cut with an error event, and the
// remaining connections closed.
func drain(srv *http.Server, served <-chan error, open *openTurns, grace time.Duration, log *slog.Logger) error {
	log.Info("draining", slog.Duration("grace", grace))
	graceCtx, cancel := context.WithTimeout(context.Background(), grace)
	defer cancel()
	err := srv.Shutdown(graceCtx)
	cut := 0
	if errors.Is(err, context.DeadlineExceeded) {
		// The cut turns write their error event and end their responses;
		// a second, short Shutdown closes their connections once idle.
		cut = open.cut()
		cutCtx, cancelCut := context.WithTimeout(context.Background(), cutWait)
		if err = srv.Shutdown(cutCtx); errors.Is(err, context.DeadlineExceeded) {
			err = srv.Close()
		}
		cancelCut()
	}
	if serr := <-served; serr != nil && !errors.Is(serr, http.ErrServerClosed) {
		return serr
	}
	if cut > 0 {
		log.Error("grace period over: cut turns in flight", slog.Int("cut", cut), slog.Duration("grace", grace))
		return fmt.Errorf("%w: cut %d after %v", errDrainCut, cut, grace)
	}
	if err != nil {
		return err
	}
	if cut == 0 && graceCtx.Err() != nil {
		log.Warn("grace period over: closed the remaining connections (no turn was in flight)")
		return nil
	}
	log.Info("drained")
	return nil
}
