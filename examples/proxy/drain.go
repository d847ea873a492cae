package main

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
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

// openTurn is one turn being served.
type openTurn struct {
	cancel context.CancelCauseFunc
}

// openTurns are the turns being served, for the drain to cut.
type openTurns struct {
	mu    sync.Mutex
	turns map[*openTurn]struct{}
}

func newOpenTurns() *openTurns { return &openTurns{turns: map[*openTurn]struct{}{}} }

// add registers t, whose cancel is set, until remove.
func (o *openTurns) add(t *openTurn) {
	o.mu.Lock()
	o.turns[t] = struct{}{}
	o.mu.Unlock()
}

func (o *openTurns) remove(t *openTurn) {
	o.mu.Lock()
	delete(o.turns, t)
	o.mu.Unlock()
}

// cut cancels every open turn with errCut, so that each ends with an error
// event (a stream) or 503 (no byte sent yet). It reports how many it cut.
func (o *openTurns) cut() int {
	o.mu.Lock()
	ts := make([]*openTurn, 0, len(o.turns))
	for t := range o.turns {
		ts = append(ts, t)
	}
	o.mu.Unlock()
	for _, t := range ts {
		t.cancel(errCut)
	}
	return len(ts)
}

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
