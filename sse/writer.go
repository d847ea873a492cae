package sse

import (
	"errors"
	"io"
	"net/http"
)

// Writer forwards an SSE stream to a client, flushing after every write so
// that each event leaves at once. It does not set response headers; the
// caller sets Content-Type (text/event-stream) and the status before the
// first write.
//
// A Writer is not safe for concurrent use.
type Writer struct {
	w       io.Writer
	rc      http.ResponseController // when w is an http.ResponseWriter (flush nil)
	flush   func() error
	noFlush bool
}

// NewWriter returns a Writer on w. On an http.ResponseWriter, flushing goes
// through http.NewResponseController, so it works through wrappers that
// implement Unwrap; any other w is flushed with its Flush() error or
// Flush() method. If w cannot flush at all, writes still succeed and the
// bytes leave when w sends them.
func NewWriter(w io.Writer) *Writer {
	sw := &Writer{w: w}
	switch f := w.(type) {
	case http.ResponseWriter:
		// Kept by value: no controller or method value to allocate.
		sw.rc = *http.NewResponseController(f)
	case interface{ Flush() error }:
		sw.flush = f.Flush
	case interface{ Flush() }:
		sw.flush = func() error { f.Flush(); return nil }
	default:
		sw.noFlush = true
	}
	return sw
}

// WriteRaw writes raw unchanged (for example Event.Raw) and flushes.
func (w *Writer) WriteRaw(raw []byte) error {
	if _, err := w.w.Write(raw); err != nil {
		return err
	}
	return w.Flush()
}

// Write writes raw SSE bytes without flushing, for a caller that knows
// more events follow at once (see Reader.Ready); a later WriteRaw or Flush
// sends them.
func (w *Writer) Write(raw []byte) (int, error) { return w.w.Write(raw) }

// Flush sends buffered bytes to the client. It returns nil if the
// underlying ResponseWriter does not support flushing.
func (w *Writer) Flush() error {
	if w.noFlush {
		return nil
	}
	var err error
	if w.flush != nil {
		err = w.flush()
	} else {
		err = w.rc.Flush()
	}
	if errors.Is(err, http.ErrNotSupported) {
		w.noFlush = true
		return nil
	}
	return err
}
