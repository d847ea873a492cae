package kvroute

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"strconv"
	"strings"
	"sync/atomic"
	"time"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
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
	if id, ok := strings.CutPrefix(hr.URL.Path, pathConversations); ok {
		r.endConversation(w, hr, id)
		return
	}
	a, ok := apiFor(hr.URL.Path)
	if !ok {
		writeAPIError(w, shapeFor(hr.URL.Path), http.StatusNotFound, errors.New("kvroute: no route for "+hr.URL.Path))
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

// pathConversations is where the OpenAI Conversations API names a
// conversation: DELETE /v1/conversations/{id} ends one.
const pathConversations = "/v1/conversations/"

// endConversation serves DELETE /v1/conversations/{id}: a client that is
// done with a conversation it keys by id (ContinuationKeys.ByConversationID:
// the id as a turn's conversation_id, session_id, prompt_cache_key or
// X-Session-ID names it) ends it, for the principal asking (its tenant, as
// a turn without cache_salt has): the stored handle is dropped and, with
// DecodeMemory on, its hold released on the decode engine now instead of
// pinning it until the TTL; the ledger counts the conversation as ended.
// The answer is the Conversations API's deleted object, "deleted" telling
// whether a handle was held. A router that keys conversations by content
// has no id to end: 404.
func (r *Router) endConversation(w http.ResponseWriter, hr *http.Request, id string) {
	shape := shapeFor(PathResponses)
	keys, byID := r.ident.(ContinuationKeys)
	switch {
	case hr.Method != http.MethodDelete:
		w.Header().Set("Allow", http.MethodDelete)
		writeAPIError(w, shape, http.StatusMethodNotAllowed, errors.New("kvroute: "+pathConversations+"{id} takes DELETE"))
		return
	case id == "" || strings.Contains(id, "/"):
		writeAPIError(w, shape, http.StatusNotFound, errors.New("kvroute: no route for "+hr.URL.Path))
		return
	case !byID || !keys.ByConversationID:
		writeAPIError(w, shape, http.StatusNotFound, errors.New("kvroute: conversations are keyed by their content here, "+
			"not by an id: there is none to delete (ContinuationKeys.ByConversationID; the proxy's --key-mode conversation-id)"))
		return
	}
	body, _ := json.Marshal(map[string]string{"conversation_id": id})
	req := &Request{Path: PathResponses, Header: hr.Header, Body: body}
	req.setPrincipal(hr.Context())
	req.tenant = r.tenant(req)
	// The delete completes once asked, as a turn's retain does, even if
	// the client leaves: its end is no Store failure.
	held, err := r.handles.drop(context.WithoutCancel(hr.Context()), explicitKey(req))
	if err != nil {
		writeAPIError(w, shape, http.StatusServiceUnavailable, fmt.Errorf("kvroute: retention store: %w", err))
		return
	}
	out, _ := json.Marshal(struct {
		ID      string `json:"id"`
		Object  string `json:"object"`
		Deleted bool   `json:"deleted"`
	}{id, "conversation.deleted", held})
	writeJSON(w, http.StatusOK, out)
}

func isJSONObject(b []byte) bool {
	_, err := jsonraw.Parse(b)
	return err == nil
}

// writeAPIError writes err in the API's error shape.
func writeAPIError(w http.ResponseWriter, a errorShape, status int, err error) {
	writeJSON(w, status, a.body(status, err))
}

// writeJSON writes the JSON body b with status and its length.
func writeJSON(w http.ResponseWriter, status int, b []byte) {
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

// buffers are the Router's pools and the sizes the last turns needed, so
// that a turn does not allocate its largest buffers: request bodies
// (ServeHTTP), render answers (held until D's first stream event, whose
// prompt ids are compared with the answer's text), decode stream buffers,
// a stream's decode handle, the prompt's token ids, and the fingerprint,
// store entry and expanded handle of a turn. Each turn takes them through
// its turnBufs, which returns them once, when the turn ends.
type buffers struct {
	bytes bufpool.Bytes
	ids   bufpool.IDs
	// The size the last stream's buffer, render answer of unknown length,
	// decode handle and prompt ids needed, for the next one's.
	stream, render, handle, promptIDs atomic.Int64
}

// maxStreamHint bounds the buffer a stream starts with: a huge stream grows
// its own rather than making every later stream take one as large.
const maxStreamHint = 1 << 20

// hint records size n (bounded by maxStreamHint) in h.
func hint(h *atomic.Int64, n int) { h.Store(int64(min(n, maxStreamHint))) }

// turnBufs owns the pooled buffers of one turn and gives them back once,
// when the turn ends (release), except those a stream returns itself from
// the goroutine that reads it (its reader's buffer and its handle's, see
// Response.recycle). Its fields are the turn's; the Response reads the
// render answer's text on the goroutine that calls Next, and releases it
// from there (renderInStream), since Close may run on another goroutine.
type turnBufs struct {
	b *buffers
	// rendered are the prompt's token ids from a render answer (pooled
	// when renderedPooled), renderBuf that answer's pooled buffer and
	// renderText, in it, the text of its id array, kept until D's first
	// event was compared with it; renderInStream says a streaming
	// Response took the text, which it then releases.
	rendered              []uint32
	renderedPooled        bool
	renderBuf, renderText []byte
	renderInStream        bool
	// streamIDs is the pooled slice a stream's capture parses the prompt's
	// ids into; promptIDs the ids it ended with (streamIDs' array, a larger
	// slice it grew, or rendered).
	streamIDs, promptIDs []uint32
	// expanded is the retained handle taken, expanded into a pooled
	// buffer from its compacted form.
	expanded []byte
}

// get returns a pooled byte buffer of length n; put gives one back.
func (t *turnBufs) get(n int) []byte { return t.b.bytes.Get(n) }
func (t *turnBufs) put(b []byte)     { t.b.bytes.Put(b) }

// fingerprint returns a pooled buffer for a fingerprint of n tokens in
// blocks of bs, to be given back with put once the entry is encoded.
func (t *turnBufs) fingerprint(n, bs int) []byte { return t.get(fingerprint.Size(n, bs)) }

// holdRender keeps a render answer's ids (pooled) and its buffer buf with,
// in it, the text of the id array, until D's first stream event has been
// compared with it (capture.Chunks.ExpectPromptIDs: D's prompt_token_ids
// are the rendered ids when their text is the same) or the turn ends. One
// pooled buffer per turn in flight, about 6.5 bytes per prompt token, is
// held from the render call until D's first event.
func (t *turnBufs) holdRender(ids []uint32, buf, text []byte) {
	t.releaseRenderText()
	t.renderBuf, t.renderText = buf, text
	t.rendered, t.renderedPooled = ids, true
}

// releaseRenderText returns the render answer's buffer to the pool.
func (t *turnBufs) releaseRenderText() {
	if t.renderBuf != nil {
		t.put(t.renderBuf)
	}
	t.renderBuf, t.renderText, t.renderInStream = nil, nil, false
}

// streamIDBuffer returns a pooled slice as large as the last stream's
// prompt ids, for a capture to parse the prompt's ids into.
func (t *turnBufs) streamIDBuffer() []uint32 {
	t.streamIDs = t.b.ids.Get(int(t.b.promptIDs.Load()))
	return t.streamIDs
}

// streamBuffer returns a pooled buffer as large as the last stream needed
// (D's first chunk carries the prompt's ids in token mode); recycleStream
// gives it back at the stream's end.
func (t *turnBufs) streamBuffer() []byte {
	return t.get(max(int(t.b.stream.Load()), bufpool.MinPooled))
}

func (t *turnBufs) recycleStream(b []byte) {
	hint(&t.b.stream, cap(b))
	t.put(b)
}

// handleBuffer returns a pooled buffer as large as the last stream's decode
// handle; releaseHandle gives it back once the handle is retained.
func (t *turnBufs) handleBuffer() []byte {
	return t.get(max(int(t.b.handle.Load()), bufpool.MinPooled))
}

func (t *turnBufs) releaseHandle(b []byte) {
	hint(&t.b.handle, len(b))
	t.put(b)
}

// release gives back what the turn still holds; it reports whether the
// stream's prompt ids were the rendered ones (one slice, returned once).
func (t *turnBufs) release() (promptIsRendered bool) {
	if t.renderInStream {
		// A stream closed before its first data event: its capture may
		// still hold the text, so the buffer is left to the collector.
		t.renderBuf, t.renderText, t.renderInStream = nil, nil, false
	}
	t.releaseRenderText()
	if t.expanded != nil {
		t.put(t.expanded)
		t.expanded = nil
	}
	promptIsRendered = fingerprint.SameIDs(t.promptIDs, t.rendered)
	if t.renderedPooled {
		t.b.ids.Put(t.rendered)
		t.rendered, t.renderedPooled = nil, false
	}
	if t.streamIDs != nil {
		// The capture parsed into it, or into a larger slice it grew
		// (returned too, and kept if of a class's size), or took the
		// rendered ids (returned above).
		hint(&t.b.promptIDs, len(t.promptIDs))
		t.b.ids.Put(t.streamIDs)
		if !promptIsRendered && !bufpool.SameArray(t.promptIDs, t.streamIDs) {
			t.b.ids.Put(t.promptIDs)
		}
		t.streamIDs, t.promptIDs = nil, nil
	}
	return promptIsRendered
}
