package kvroute

import (
	"sync/atomic"

	"github.com/bidikv/bidikv/kvroute/internal/bufpool"
	"github.com/bidikv/bidikv/kvroute/internal/fingerprint"
)

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
