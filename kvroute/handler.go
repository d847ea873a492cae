package kvroute

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
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
	writeError := func(w http.ResponseWriter, status int, err error) { writeAPIError(w, a, status, err) }
	if hr.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		writeError(w, http.StatusMethodNotAllowed, errors.New("kvroute: use POST"))
		return
	}
	body, ref, err := r.readBody(http.MaxBytesReader(w, hr.Body, r.cfg.maxBodyBytes), hr.ContentLength, r.cfg.maxBodyBytes)
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
			slog.String("request_id", resp.RequestID()), slog.String("err", err.Error()))
		if resp.Streaming() {
			_ = sse.NewWriter(w).WriteRaw(resp.ErrorEvent(err))
		}
	}
}

func isJSONObject(b []byte) bool {
	_, err := jsonraw.Parse(b)
	return err == nil
}

func writeError(w http.ResponseWriter, status int, err error) {
	writeAPIError(w, openAI{}, status, err)
}

// errorShaper is the part of an api that shapes errors.
type errorShaper interface {
	errorBody(status int, err error) []byte
}

// writeAPIError writes err in the API's error shape.
func writeAPIError(w http.ResponseWriter, a errorShaper, status int, err error) {
	b := a.errorBody(status, err)
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(status)
	_, _ = w.Write(b)
}

// sseError frames an error as the SSE event vLLM itself sends when a
// stream fails.
func sseError(status int, err error) []byte {
	b := errorBody(status, err)
	out := make([]byte, 0, len(b)+8)
	out = append(out, "data: "...)
	out = append(out, b...)
	return append(out, "\n\n"...)
}

// readBody reads a request body. With a Content-Length within the limit
// it reads into one pooled buffer of that size, where io.ReadAll would grow
// a buffer by doubling (and hold up to twice the body, in copies); the
// returned reference (nil otherwise) gives it back to the pool.
func (rt *Router) readBody(r io.Reader, length, limit int64) ([]byte, *bodyRef, error) {
	if length <= 0 || length > limit {
		b, err := io.ReadAll(r)
		return b, nil, err
	}
	b := rt.bufs.get(int(length))
	ref := &bodyRef{buf: b, pool: &rt.bufs}
	ref.rel = ref.release
	ref.n.Store(1)
	if _, err := io.ReadFull(r, b); err != nil {
		ref.release()
		if errors.Is(err, io.ErrUnexpectedEOF) {
			return nil, nil, fmt.Errorf("the body is shorter than its Content-Length: %w", err)
		}
		return nil, nil, err
	}
	// net/http enforces Content-Length; anything after it is an error.
	var one [1]byte
	if n, _ := r.Read(one[:]); n > 0 {
		ref.release()
		return nil, nil, errors.New("the body is longer than its Content-Length")
	}
	return b, ref, nil
}
