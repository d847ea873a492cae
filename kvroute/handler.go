package kvroute

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/sse"
)

// ServeHTTP serves POST /v1/chat/completions, /v1/completions,
// /v1/responses and /v1/messages (a query string such as ?beta=true is
// ignored) by running Do. Errors before the response reach the client in
// the API's JSON error shape (OpenAI's; Anthropic's for /v1/messages) with
// the status HTTPStatus gives and, on a 503, Retry-After (RetryAfter); an
// engine's own 4xx error body is passed through. Messages name the phase
// that failed, never an engine's address. Once a stream's headers are sent, an error can only end the
// stream: the client gets the API's error event (`data: {"error":{...}}`,
// or Anthropic's `event: error`) and the connection is closed without the
// stream's final event.
func (r *Router) ServeHTTP(w http.ResponseWriter, hr *http.Request) {
	a, ok := apiFor(hr.URL.Path)
	if !ok {
		b := ErrorBody(hr.URL.Path, http.StatusNotFound, errors.New("kvroute: no route for "+hr.URL.Path))
		w.Header().Set("Content-Type", "application/json")
		w.Header().Set("Content-Length", strconv.Itoa(len(b)))
		w.WriteHeader(http.StatusNotFound)
		_, _ = w.Write(b)
		return
	}
	writeError := func(w http.ResponseWriter, status int, err error) { writeAPIError(w, a.errors, status, err) }
	if hr.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		writeError(w, http.StatusMethodNotAllowed, errors.New("kvroute: use POST"))
		return
	}
	body, ref, err := readBody(http.MaxBytesReader(w, hr.Body, r.cfg.maxBodyBytes), hr.ContentLength, r.cfg.maxBodyBytes, &r.bufs.bytes)
	if err != nil {
		var mbe *http.MaxBytesError
		if errors.As(err, &mbe) {
			writeError(w, http.StatusRequestEntityTooLarge, errors.New("kvroute: request body larger than "+strconv.FormatInt(mbe.Limit, 10)+" bytes"))
			return
		}
		writeError(w, http.StatusBadRequest, badRequest("reading the request body: %v", err))
		return
	}
	// The turn's reference to a pooled body, released after the response
	// (deferred first, so it runs last); upstream bodies that alias it
	// hold their own until net/http closes them.
	defer ref.release()
	resp, err := r.Do(hr.Context(), &Request{Path: hr.URL.Path, Header: hr.Header, Body: body, ref: ref})
	if err != nil {
		if hr.Context().Err() != nil {
			return // the client is gone
		}
		status := HTTPStatus(err)
		if d := RetryAfter(err); d > 0 {
			w.Header().Set("Retry-After", strconv.FormatInt(int64(d/time.Second), 10))
		}
		var ue *UpstreamError
		if errors.As(err, &ue) && status == ue.Status && status < 500 && len(ue.Body) > 0 && isJSONObject(ue.Body) {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = w.Write(ue.Body)
			return
		}
		writeError(w, status, err)
		return
	}
	defer resp.Close()
	h := w.Header()
	for k, v := range resp.Header {
		h[k] = v
	}
	if !resp.Streaming() {
		h.Set("Content-Length", strconv.Itoa(len(resp.Body)))
	}
	w.WriteHeader(resp.StatusCode)
	if _, err := resp.WriteTo(w); err != nil && hr.Context().Err() == nil {
		r.log.LogAttrs(hr.Context(), slog.LevelWarn, "kvroute: response ended with an error",
			slog.String("request_id", resp.t.id), slog.String("err", err.Error()))
		if resp.Streaming() {
			_ = sse.NewWriter(w).WriteRaw(resp.ErrorEvent(err))
		}
	}
}

func isJSONObject(b []byte) bool {
	_, err := jsonraw.Parse(b)
	return err == nil
}

// writeAPIError writes err in the API's error shape.
func writeAPIError(w http.ResponseWriter, a errorShape, status int, err error) {
	b := a.body(status, err)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// firstBodyBuffer is the buffer a request body of known length is first
// read into: it then grows by doubling, up to the length, as bytes arrive.
const firstBodyBuffer = 64 << 10

// nextBodyBuffer is the size of the buffer that replaces a full one of
// size cur while a body of length n is read: doubling, but straight to the
// length once that is at most twice the doubled size, so that a body that
// flows gets its final buffer one step early, and a buffer is never more
// than four times what arrived (cur bytes).
func nextBodyBuffer(cur, n int) int {
	next := 2 * cur
	if 2*next >= n {
		next = n
	}
	return next
}

// readBody reads a request body. With a Content-Length within the limit
// it reads into pooled buffers that grow with what has arrived (doubling
// from firstBodyBuffer up to exactly the length), so that a client that
// declares a large body and sends little holds little memory: at most
// twice what it sent, or firstBodyBuffer. The returned reference (nil for
// a body of unknown length, read with io.ReadAll) gives the buffer back to
// the pool.
func readBody(r io.Reader, length, limit int64, bufs *bufpool.Bytes) ([]byte, *bodyRef, error) {
	if length <= 0 || length > limit {
		b, err := io.ReadAll(r)
		return b, nil, err
	}
	n := int(length)
	b := bufs.Get(min(n, firstBodyBuffer))
	got := 0
	for {
		m, err := io.ReadFull(r, b[got:])
		got += m
		if err != nil {
			bufs.Put(b)
			if errors.Is(err, io.ErrUnexpectedEOF) || errors.Is(err, io.EOF) {
				return nil, nil, fmt.Errorf("the body is shorter than its Content-Length: %w", io.ErrUnexpectedEOF)
			}
			return nil, nil, err
		}
		if got == n {
			break
		}
		nb := bufs.Get(nextBodyBuffer(len(b), n))
		copy(nb, b[:got])
		bufs.Put(b)
		b = nb
	}
	// net/http enforces Content-Length; anything after it is an error, and
	// so is a reader that fails at the end (a caller's wrapper refusing
	// the body).
	var one [1]byte
	if m, err := r.Read(one[:]); m > 0 || (err != nil && err != io.EOF) {
		bufs.Put(b)
		if m > 0 {
			err = errors.New("the body is longer than its Content-Length")
		}
		return nil, nil, err
	}
	ref := &bodyRef{buf: b, pool: bufs}
	ref.rel = ref.release
	ref.n.Store(1)
	return b, ref, nil
}

// bodyRef is a pooled request body and its references. ServeHTTP holds
// the first, for the turn; a holder hands one more to each reader that may
// outlive it (an upstream request body, until net/http closes it; the
// background render's goroutine, until it ends) by calling hold before that
// reader starts, never from inside it, and every reference is released
// exactly once, by its holder. The last release returns the buffer to the
// pool. A reference asked for after the last release (a reader that started
// too late) is refused: in a build with bufpool.Checked it panics, as does
// a release of more references than were held; otherwise hold reports
// false and the reader fails its request (errBodyReleased) instead of
// sending whatever the pool has put in the buffer since, another request's
// bytes. A nil *bodyRef (a body the router does not own) counts nothing.
type bodyRef struct {
	n    atomic.Int32
	buf  []byte
	pool *bufpool.Bytes
	rel  func() // release, made once for every upstream body's onClose
}

// errBodyReleased fails an upstream request whose reader asked for the
// client's body after the turn had released it.
var errBodyReleased = errors.New("kvroute: the request body was used after its release")

// hold takes one more reference for a new reader; the caller holds one. It
// reports false when the body was released already.
func (b *bodyRef) hold() bool {
	if b == nil {
		return true
	}
	for {
		n := b.n.Load()
		if n <= 0 {
			if bufpool.Checked {
				panic("kvroute: a reference to a request body taken after its release")
			}
			return false
		}
		if b.n.CompareAndSwap(n, n+1) {
			return true
		}
	}
}

// release gives one reference back; the last returns the buffer.
func (b *bodyRef) release() {
	if b == nil {
		return
	}
	switch n := b.n.Add(-1); {
	case n == 0:
		b.pool.Put(b.buf)
	case n < 0 && bufpool.Checked:
		panic("kvroute: a request body released more times than it was held")
	}
}
