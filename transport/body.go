package transport

import (
	"errors"
	"io"
	"sync"
)

// body enforces the idle and total deadlines while the response is read.
type body struct {
	rc io.ReadCloser
	x  exchange

	mu   sync.Mutex // guards x.stopped and timer resets against Close
	once sync.Once
}

// Read reads from the upstream body. A read that returns data restarts the
// idle deadline; io.EOF ends the exchange and stops every timer.
func (b *body) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	if n > 0 || err != nil {
		b.mu.Lock()
		switch {
		case errors.Is(err, io.EOF):
			b.x.finish()
		case n > 0 && b.x.idling.Load() && !b.x.stopped:
			b.x.phase.Reset(b.x.idleLimit)
		}
		b.mu.Unlock()
	}
	if err != nil && err != io.EOF {
		err = b.x.fix(err, func(te *timeoutError) error { return te })
	}
	return n, err
}

// Close closes the upstream body, stops every timer and releases the
// exchange's context. It is safe to call more than once and concurrently
// with Read.
func (b *body) Close() error {
	var err error
	b.once.Do(func() {
		b.mu.Lock()
		b.x.finish()
		b.mu.Unlock()
		err = b.rc.Close()
		b.x.cancel(nil)
	})
	return err
}
