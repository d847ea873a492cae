package main

import (
	"bytes"
	"context"
	"errors"
	"io"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"
)

// Why a body read was stopped by the proxy rather than by the client.
var (
	errBodyBudget  = errors.New("proxy: request body bytes held at once reached --max-buffered-bytes")
	errBodyTurns   = errors.New("proxy: completion requests served at once reached --max-concurrent-turns")
	errBodyTimeout = errors.New("proxy: request body not received within --read-body-timeout")
	errBodySlow    = errors.New("proxy: request body arrived below --min-body-rate while a new body needed its slot")
)

// admit serves a completion request through the admission (admission.go):
// its body is charged as a body in transit, for its client address too,
// and each byte as it arrives; once the body is in, the request becomes a
// turn and takes a turn slot. What does not fit is shed with 503 and
// Retry-After. The body must arrive within --read-body-timeout (set in
// routes); the deadline is lifted once it has, so streams run as long as
// they need. The turn is registered for the drain.
func (s *server) admit(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.ContentLength > s.maxBodyBytes {
			s.reject(w, r, http.StatusRequestEntityTooLarge, "too_large",
				"request body larger than "+strconv.FormatInt(s.maxBodyBytes, 10)+" bytes")
			return
		}
		cc := connFrom(r.Context())
		// The turn's body reader and writer, in one allocation.
		st := &admitted{ctl: *http.NewResponseController(w)}
		if cc != nil {
			st.tb.client = cc.client
		}
		st.tb.stop = func() { _ = st.ctl.SetReadDeadline(time.Unix(1, 0)) }
		if why, ok := s.adm.startBody(&st.tb); !ok {
			s.shed(w, r.URL.Path, why)
			return
		}
		body := &st.body
		*body = bodyReader{rc: r.Body, s: s, tb: &st.tb, transit: true, limit: s.maxBodyBytes, ctl: &st.ctl}
		defer body.done()

		tw := &st.tw
		*tw = turnWriter{ResponseWriter: w, req: r, st: st, body: body, s: s, ctl: body.ctl, writeTimeout: s.writeTimeout, seq: -1}
		if cc != nil && s.writeTimeout > 0 {
			tw.acks = ackWatch{cc: cc, limit: s.writeTimeout}
		}
		// As with http.MaxBytesReader: the handler's body is the wrapper.
		// The turn's state rides in its context, for the charge of its
		// decode answer (admission.chargeAnswer).
		r = r.WithContext(context.WithValue(r.Context(), admittedKey{}, st))
		r.Body = body
		next.ServeHTTP(tw, r)

		switch {
		case body.tooLarge:
			s.metrics.rejected.WithLabelValues(strconv.Itoa(http.StatusRequestEntityTooLarge), "too_large").Inc()
		case tw.replaced:
		case tw.stalled:
			s.metrics.stalled.Inc()
		case body.err != nil && tw.wrote:
			s.metrics.rejected.WithLabelValues(statusLabel(tw.status), "body_error").Inc()
		case body.err != nil:
			// The client went away before an answer: nothing to count.
		case errors.Is(context.Cause(r.Context()), errCut):
			tw.cut()
		}
	})
}

// shed answers 503 with Retry-After in the error shape of path's API, and
// closes the connection: net/http would otherwise wait for the rest of an
// unread body, to discard it.
func (s *server) shed(w http.ResponseWriter, path string, why shedReason) {
	w.Header().Set("Retry-After", strconv.Itoa(retryAfterSeconds))
	w.Header().Set("Connection", "close")
	s.metrics.rejected.WithLabelValues(strconv.Itoa(http.StatusServiceUnavailable), "overloaded_"+why.what).Inc()
	b := proxyError(path, http.StatusServiceUnavailable, "overloaded: "+why.flag+" reached; retry later", "server_error", "overloaded")
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Content-Length", strconv.Itoa(len(b)))
	w.WriteHeader(http.StatusServiceUnavailable)
	_, _ = w.Write(b)
}

// admitted is what admit keeps for one turn.
type admitted struct {
	tb   transitBody
	body bodyReader
	tw   turnWriter
	ctl  http.ResponseController // of the connection's ResponseWriter
	// answerShed: the turn's decode answer did not fit
	// --max-buffered-bytes; the router's 503 becomes the proxy's.
	answerShed atomic.Bool
}

// admittedKey is the request context key of the turn's *admitted.
type admittedKey struct{}

// bodyReader is a request's body on its way through the admission: it
// charges bytes to the budget as they arrive, notes a body above the limit
// (the router answers 413), maps an expired read deadline to
// errBodyTimeout (errBodySlow when the admission cut the body to admit
// another), and at the end of the body ends the body's transit, lifts the
// deadline and takes a turn slot for the request.
type bodyReader struct {
	rc       io.ReadCloser
	s        *server
	tb       *transitBody
	limit    int64
	ctl      *http.ResponseController
	n        int64
	charged  int64
	transit  bool  // counted as a body in transit
	turn     bool  // holds a turn slot
	tooLarge bool  // more than limit bytes arrived
	err      error // the read error that ended the body early, errBody* when the proxy stopped it
}

func (b *bodyReader) Read(p []byte) (int, error) {
	if b.err != nil {
		return 0, b.err
	}
	n, err := b.rc.Read(p)
	b.n += int64(n)
	if b.transit {
		b.tb.n.Store(b.n)
	}
	if b.n > b.limit {
		b.tooLarge = true
	}
	if want := min(b.n, b.limit+1) - b.charged; want > 0 {
		if !b.s.adm.charge(want) {
			b.err = errBodyBudget
			return 0, b.err
		}
		b.charged += want
	}
	switch {
	case err == io.EOF:
		// The transit ends first: once it has, the admission never
		// stops the body's reads, and the deadline lifted stays lifted.
		b.endTransit()
		_ = b.ctl.SetReadDeadline(time.Time{})
		if !b.in() {
			b.err = errBodyTurns
			return 0, b.err
		}
	case err != nil:
		var ne interface{ Timeout() bool }
		if errors.As(err, &ne) && ne.Timeout() {
			err = errBodyTimeout
			if b.tb.gone.Load() {
				err = errBodySlow
			}
		}
		b.err = err
	}
	return n, err
}

// in ends the body's transit and takes a turn slot, or reports false at
// --max-concurrent-turns.
func (b *bodyReader) in() bool {
	if b.turn {
		return true
	}
	b.endTransit()
	if !b.s.adm.enter() {
		return false
	}
	b.turn = true
	b.s.metrics.inflight.Inc()
	// The drain cuts a turn through the request's own context, which
	// derives from the server's base context (openTurns).
	b.s.open.add()
	return true
}

func (b *bodyReader) endTransit() {
	if b.transit {
		b.transit = false
		b.s.adm.endBody(b.tb)
	}
}

// done releases what the request holds, when its handler returns.
func (b *bodyReader) done() {
	b.endTransit()
	if b.turn {
		b.turn = false
		b.s.open.remove()
		b.s.metrics.inflight.Dec()
		b.s.adm.leave()
	}
	b.s.adm.release(b.charged)
	b.charged = 0
}

func (b *bodyReader) Close() error { return b.rc.Close() }

// turnWriter is a turn's ResponseWriter. When the proxy stopped the body
// (budget, turn slots or deadline), the router's answer (a 400 about the
// read) is replaced by the proxy's own: 503 with Retry-After, or 408.
//
// A client that stops reading is cut after writeTimeout
// (--client-write-timeout) and its turn freed: each write and flush must
// complete within it, and (on Linux) every byte written must be
// acknowledged by the client's TCP within it (ackWatch), so that the
// kernel's send buffer, which absorbs minutes of a slow stream before a
// write blocks, does not hide the stall. The cut fails the write, which
// ends the turn (net/http cancels the request's context on a failed write
// and closes the connection).
type turnWriter struct {
	http.ResponseWriter
	req          *http.Request // the turn's request: its path picks the error shape
	st           *admitted
	body         *bodyReader
	s            *server
	ctl          *http.ResponseController // of the ResponseWriter
	writeTimeout time.Duration
	acks         ackWatch
	wrote        bool  // headers went out
	status       int   // their status
	replaced     bool  // the router's answer was replaced
	stream       bool  // the response is an event stream
	finished     bool  // the last write was the stream's final event
	stalled      bool  // cut: the client stopped reading
	seq          int64 // a Responses stream's last sequence_number, -1 before any
}

// errStalled ends the writes of a turn whose client stopped reading.
var errStalled = errors.New("proxy: the client acknowledged no byte within --client-write-timeout")

func (w *turnWriter) WriteHeader(code int) {
	if w.wrote || w.replaced {
		return
	}
	if w.st != nil && w.st.answerShed.Load() && code == http.StatusServiceUnavailable {
		w.replaced = true
		w.s.shed(w.ResponseWriter, w.req.URL.Path, shedAnswerBytes)
		return
	}
	switch w.body.err {
	case errBodyBudget:
		w.replaced = true
		w.s.shed(w.ResponseWriter, w.req.URL.Path, shedBytes)
		return
	case errBodyTurns:
		w.replaced = true
		w.s.shed(w.ResponseWriter, w.req.URL.Path, shedTurns)
		return
	case errBodyTimeout:
		w.replaced = true
		w.ResponseWriter.Header().Set("Connection", "close")
		w.s.reject(w.ResponseWriter, w.req, http.StatusRequestTimeout, "body_timeout",
			"request body not received within "+w.s.readBodyTimeout.String())
		return
	case errBodySlow:
		w.replaced = true
		w.ResponseWriter.Header().Set("Connection", "close")
		w.s.reject(w.ResponseWriter, w.req, http.StatusRequestTimeout, "body_too_slow",
			"request body arrived below --min-body-rate ("+strconv.FormatInt(w.s.adm.lim.minBodyRate, 10)+
				" bytes/s) while the proxy was full of bodies in transit; send it faster or retry later")
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
	if w.stalled {
		return 0, errStalled
	}
	w.finished = finalEvent(p)
	if w.stream && numbered(w.req.URL.Path) {
		w.seq = lastSequence(p, w.seq)
	}
	w.deadline()
	n, err := w.ResponseWriter.Write(p)
	if err == nil && w.acks.stalled(time.Now()) {
		return n, w.stall()
	}
	w.noteTimeout(err)
	return n, err
}

// deadline bounds the next write to the client.
func (w *turnWriter) deadline() {
	if w.writeTimeout > 0 && w.ctl != nil {
		_ = w.ctl.SetWriteDeadline(time.Now().Add(w.writeTimeout))
	}
}

// stall cuts the turn of a client that stopped reading: the connection's
// next write fails at once.
func (w *turnWriter) stall() error {
	w.stalled = true
	if w.ctl != nil {
		_ = w.ctl.SetWriteDeadline(time.Unix(1, 0))
	}
	return errStalled
}

// noteTimeout marks the turn stalled when a write blocked beyond its
// deadline.
func (w *turnWriter) noteTimeout(err error) {
	var ne interface{ Timeout() bool }
	if err != nil && errors.As(err, &ne) && ne.Timeout() {
		w.stalled = true
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
	if w.stalled {
		return errStalled
	}
	w.deadline()
	err := http.NewResponseController(w.ResponseWriter).Flush()
	if err == nil && w.acks.stalled(time.Now()) {
		return w.stall()
	}
	w.noteTimeout(err)
	return err
}

func (w *turnWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// ackWatch bounds how long bytes written to a client may stay
// unacknowledged by its TCP: the time from the write of a byte to its
// acknowledgement must stay within limit, checked at each write after it.
// A client whose kernel still accepts bytes into its receive buffer
// acknowledges them: what that buffer holds (its size when the client
// stopped reading, 128 KiB to a few MiB on Linux) is not bounded here.
type ackWatch struct {
	cc    *clientConn // nil: no watch
	limit time.Duration
	mark  int64     // the connection's byte count at a write not yet known acknowledged, 0: none
	at    time.Time // when that write was made
}

// stalled reports whether the bytes of the marked write are still
// unacknowledged after limit, and marks the last write when none is.
func (a *ackWatch) stalled(now time.Time) bool {
	if a.cc == nil {
		return false
	}
	q, ok := a.cc.sendQueue()
	if !ok {
		a.cc = nil // no socket to ask: the write deadline alone
		return false
	}
	written := a.cc.written.Load()
	if a.mark > 0 && written-q < a.mark {
		return now.Sub(a.at) > a.limit
	}
	a.mark, a.at = 0, time.Time{}
	if q > 0 {
		a.mark, a.at = written, now
	}
	return false
}

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
		a, _ := apiAt(w.req.URL.Path)
		switch a.StreamErrorShape {
		case "anthropic": // Anthropic's error event
			ev = append([]byte("event: error\ndata: "), anthropicErrorBody(http.StatusServiceUnavailable, msg)...)
		case "responses": // the Responses API's
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

// numbered reports whether the stream of the router's API at path numbers
// its events (the Responses API's sequence_number).
func numbered(path string) bool {
	a, _ := apiAt(path)
	return a.StreamErrorShape == "responses"
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
