package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/bidikv/bidikv/kvroute"
)

// retryAfterSeconds is the Retry-After of a shed request: admitted turns
// are expected to free room within about this long.
const retryAfterSeconds = 1

// admission bounds the completion requests served at once and the request
// body bytes they hold. It never queues: what does not fit is shed at once
// with 503, so admitted turns keep their memory and finish.
type admission struct {
	mu       sync.Mutex
	turns    int
	maxTurns int
	bytes    int64
	maxBytes int64
}

// enter admits one turn, or reports false when --max-concurrent-turns
// are being served.
func (a *admission) enter() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.turns >= a.maxTurns {
		return false
	}
	a.turns++
	return true
}

func (a *admission) leave() {
	a.mu.Lock()
	a.turns--
	a.mu.Unlock()
}

// reserve takes n bytes of the buffer budget, or reports false when they
// do not fit.
func (a *admission) reserve(n int64) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.bytes+n > a.maxBytes {
		return false
	}
	a.bytes += n
	return true
}

func (a *admission) release(n int64) {
	a.mu.Lock()
	a.bytes -= n
	a.mu.Unlock()
}

// held returns the turns admitted and the bytes reserved now.
func (a *admission) held() (int, int64) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.turns, a.bytes
}

// Why a body read was stopped by the proxy rather than by the client.
var (
	errBodyBudget  = errors.New("proxy: request body bytes held at once reached --max-buffered-bytes")
	errBodyTimeout = errors.New("proxy: request body not received within --read-body-timeout")
)

// admit serves a completion request when it fits: a free turn slot, and
// room in the byte budget for its body (its Content-Length up front, or
// the bytes as they arrive for a chunked body). The body must arrive
// within --read-body-timeout (set in routes); the deadline is lifted once
// it has, so streams run as long as they need. The turn is registered for the drain.
func (s *server) admit(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > s.maxBodyBytes {
			s.reject(w, r, http.StatusRequestEntityTooLarge, "too_large",
				"request body larger than "+strconv.FormatInt(s.maxBodyBytes, 10)+" bytes")
			return
		}
		if !s.adm.enter() {
			s.shed(w, r.URL.Path, "turns", "--max-concurrent-turns reached")
			return
		}
		defer s.adm.leave()
		s.metrics.inflight.Inc()
		defer s.metrics.inflight.Dec()
		// The turn's body reader and writer, in one allocation.
		st := &admitted{ctl: *http.NewResponseController(w)}
		body := &st.body
		*body = bodyReader{rc: r.Body, adm: s.adm, limit: s.maxBodyBytes, ctl: &st.ctl}
		defer func() { s.adm.release(body.reserved) }()
		if r.ContentLength > 0 {
			if !s.adm.reserve(r.ContentLength) {
				s.shed(w, r.URL.Path, "bytes", "--max-buffered-bytes reached")
				return
			}
			body.reserved = r.ContentLength
			body.prepaid = true
		}

		// The drain cuts a turn through the request's own context, which
		// derives from the server's base context (openTurns).
		s.open.add()
		defer s.open.remove()

		tw := &st.tw
		*tw = turnWriter{ResponseWriter: w, req: r, body: body, s: s, ctl: body.ctl, writeTimeout: s.writeTimeout, seq: -1}
		// As with http.MaxBytesReader: the handler's body is the wrapper.
		r.Body = body
		next.ServeHTTP(tw, r)

		switch {
		case body.tooLarge:
			s.metrics.rejected.WithLabelValues(strconv.Itoa(http.StatusRequestEntityTooLarge), "too_large").Inc()
		case tw.replaced:
		case body.err != nil && tw.wrote:
			s.metrics.rejected.WithLabelValues(strconv.Itoa(tw.status), "body_error").Inc()
		case body.err != nil:
			// The client went away before an answer: nothing to count.
		case errors.Is(context.Cause(r.Context()), errCut):
			tw.cut()
		}
	})
}

// shed answers 503 with Retry-After in the error shape of path's API.
func (s *server) shed(w http.ResponseWriter, path, what, msg string) {
	w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds))
	s.metrics.rejected.WithLabelValues(strconv.Itoa(http.StatusServiceUnavailable), "overloaded_"+what).Inc()
	b := proxyError(path, http.StatusServiceUnavailable, "overloaded: "+msg+"; retry later", "server_error", "overloaded")
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusServiceUnavailable)
	_, _ = w.Write(b)
}

// admitted is what admit keeps for one turn.
type admitted struct {
	body bodyReader
	tw   turnWriter
	ctl  http.ResponseController // of the connection's ResponseWriter
}

// bodyReader is a turn's request body: it reserves chunked bytes in the
// budget as they arrive, notes a body above the limit (the router answers
// 413), maps an expired read deadline to errBodyTimeout, and lifts the
// deadline at the end of the body.
type bodyReader struct {
	rc       io.ReadCloser
	adm      *admission
	limit    int64
	ctl      *http.ResponseController
	n        int64
	reserved int64
	prepaid  bool  // Content-Length reserved up front
	tooLarge bool  // more than limit bytes arrived
	err      error // the read error that ended the body early, errBody* when the proxy stopped it
}

func (b *bodyReader) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	n, err := b.rc.Read(p)
	b.n += int64(n)
	if b.n > b.limit {
		b.tooLarge = true
	}
	if !b.prepaid && n > 0 {
		want := min(b.n, b.limit+1) - b.reserved
		if want > 0 {
			if !b.adm.reserve(want) {
				b.err = errBodyBudget
				return 0, b.err
			}
			b.reserved += want
		}
	}
	switch {
	case err == io.EOF:
		_ = b.ctl.SetReadDeadline(time.Time{})
	case err != nil:
		var ne interface{ Timeout() bool }
		if errors.As(err, &ne) && ne.Timeout() {
			err = errBodyTimeout
		}
		b.err = err
	}
	return n, err
}

func (b *bodyReader) Close() error { return b.rc.Close() }

// turnWriter is a turn's ResponseWriter. When the proxy stopped the body
// (budget or deadline), the router's answer (a 400 about the read) is
// replaced by the proxy's own: 503 with Retry-After, or 408.
//
// Each write and flush must complete within writeTimeout: a client that
// stops reading fails the write, which ends the turn (net/http cancels
// the request's context on a failed write) instead of holding its slot.
type turnWriter struct {
	http.ResponseWriter
	req          *http.Request // the turn's request: its path picks the error shape
	body         *bodyReader
	s            *server
	ctl          *http.ResponseController // of the ResponseWriter
	writeTimeout time.Duration
	wrote        bool  // headers went out
	status       int   // their status
	replaced     bool  // the router's answer was replaced
	stream       bool  // the response is an event stream
	finished     bool  // the last write was the stream's final event
	seq          int64 // a Responses stream's last sequence_number, -1 before any
}

func (w *turnWriter) WriteHeader(code int) {
	if w.wrote || w.replaced {
		return
	}
	switch w.body.err {
	case errBodyBudget:
		w.replaced = true
		w.s.shed(w.ResponseWriter, w.req.URL.Path, "bytes", "--max-buffered-bytes reached")
		return
	case errBodyTimeout:
		w.replaced = true
		w.ResponseWriter.Header().Set("Connection", "close")
		w.s.reject(w.ResponseWriter, w.req, http.StatusRequestTimeout, "body_timeout",
			"request body not received within "+w.s.readBodyTimeout.String())
		return
	}
	w.wrote = true
	w.status = code
	w.stream = code == http.StatusOK && isEventStream(w.Header().Get("Content-Type"))
	w.ResponseWriter.WriteHeader(code)
}

func (w *turnWriter) Write(p []byte) (int, error) {
	if !w.wrote && !w.replaced {
		w.WriteHeader(http.StatusOK)
	}
	if w.replaced {
		return len(p), nil
	}
	w.finished = finalEvent(p)
	if w.stream && w.req.URL.Path == kvroute.PathResponses {
		w.seq = lastSequence(p, w.seq)
	}
	w.deadline()
	return w.ResponseWriter.Write(p)
}

// deadline bounds the next write to the client.
func (w *turnWriter) deadline() {
	if w.writeTimeout > 0 && w.ctl != nil {
		_ = w.ctl.SetWriteDeadline(time.Now().Add(w.writeTimeout))
	}
}

// FlushError sends the headers through WriteHeader first, so that a flush
// before any write is seen here.
func (w *turnWriter) FlushError() error {
	if !w.wrote && !w.replaced {
		w.WriteHeader(http.StatusOK)
	}
	if w.replaced {
		return nil
	}
	w.deadline()
	return http.NewResponseController(w.ResponseWriter).Flush()
}

func (w *turnWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// cut ends a turn the drain stopped: a stream gets an SSE error event (as
// kvroute ends a failed stream, without data: [DONE]); a turn that sent
// nothing yet gets 503. A stream that sent its final event just before is
// left as it is: an error after message_stop would make Anthropic's SDKs
// throw away a whole message.
func (w *turnWriter) cut() {
	const msg = "shutting down: the turn was cut at the end of the shutdown grace period"
	w.deadline()
	switch {
	case w.stream && !w.finished:
		var ev []byte
		switch path := w.req.URL.Path; {
		case anthropicPath(path): // Anthropic's error event
			ev = append([]byte("event: error\ndata: "), anthropicErrorBody(http.StatusServiceUnavailable, msg)...)
		case path == kvroute.PathResponses: // the Responses API's
			ev = append([]byte("event: error\ndata: "), responsesErrorJSON(msg, "shutting_down", w.seq+1)...)
		default: // OpenAI's error body as vLLM ends a failed stream
			ev = append([]byte("data: "), errorJSON(msg, "server_error", "shutting_down")...)
		}
		_, _ = w.ResponseWriter.Write(append(ev, "\n\n"...))
		_ = http.NewResponseController(w.ResponseWriter).Flush()
	case !w.wrote:
		w.ResponseWriter.Header().Set("Connection", "close")
		b := proxyError(w.req.URL.Path, http.StatusServiceUnavailable, msg, "server_error", "shutting_down")
		w.ResponseWriter.Header().Set("Content-Type", "application/json")
		w.ResponseWriter.Header().Set("Content-Length", strconv.Itoa(len(b)))
		w.ResponseWriter.WriteHeader(http.StatusServiceUnavailable)
		_, _ = w.ResponseWriter.Write(b)
	}
}

// lastSequence returns the last sequence_number of a Responses stream
// write p, or seq when p has none.
func lastSequence(p []byte, seq int64) int64 {
	const key = `"sequence_number":`
	i := bytes.LastIndex(p, []byte(key))
	if i < 0 {
		return seq
	}
	rest := bytes.TrimLeft(p[i+len(key):], " ")
	n, digits := int64(0), 0
	for _, c := range rest {
		if c < '0' || c > '9' || digits == 18 {
			break
		}
		n, digits = n*10+int64(c-'0'), digits+1
	}
	if digits == 0 {
		return seq
	}
	return n
}

// finalEvent reports whether the last event of p, a write of a stream, is
// its final one: data: [DONE] (chat, completions), or the event after which
// Responses and Messages streams send nothing (they have no [DONE]).
func finalEvent(p []byte) bool {
	last := bytes.TrimRight(p, "\n")
	if i := bytes.LastIndex(last, []byte("\n\n")); i >= 0 {
		last = last[i+2:]
	}
	return bytes.Equal(last, []byte("data: [DONE]")) ||
		bytes.HasPrefix(last, []byte("event: message_stop\n")) ||
		bytes.HasPrefix(last, []byte("event: response.completed\n")) ||
		bytes.HasPrefix(last, []byte("event: response.incomplete\n"))
}

func isEventStream(ct string) bool {
	mt, _, _ := strings.Cut(ct, ";")
	return strings.EqualFold(strings.TrimSpace(mt), "text/event-stream")
}
