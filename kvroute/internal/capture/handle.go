package capture

import (
	"bytes"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// handleCopy keeps a chunk stream's decode handle: it owns the copy of the
// last non-null top-level kv_transfer_params value, where that value's
// block list is (when the parse of its event read it), and the caller's
// buffer the copy is made in (Chunks.UseHandleBuffer) until it is handed
// back.
type handleCopy struct {
	handle []byte
	// blocks is where handle's block list is, when the parse of its
	// event read it.
	blocks jsonraw.Known
	// buf is where the handle is copied, when useBuf is set.
	buf    []byte
	useBuf bool
}

// take keeps a copy of the handle v, whose block list is at blocks.
func (h *handleCopy) take(v []byte, blocks jsonraw.Known) {
	h.blocks = blocks
	if h.useBuf {
		h.buf = append(h.buf[:0], v...)
		h.handle = h.buf
	} else {
		h.handle = bytes.Clone(v)
	}
}

// bytes returns the handle kept, or nil.
func (h *handleCopy) bytes() []byte { return h.handle }

// blockList returns where the kept handle's block list is, or the zero
// Known when no handle is kept or its parse did not read it.
func (h *handleCopy) blockList() jsonraw.Known {
	if h.handle == nil {
		return jsonraw.Known{}
	}
	return h.blocks
}

// use makes later handles be copied into buf (see Chunks.UseHandleBuffer).
func (h *handleCopy) use(buf []byte) {
	h.buf, h.useBuf = buf[:0], true
}

// release hands back the buffer (see Chunks.ReleaseHandleBuffer).
func (h *handleCopy) release() []byte {
	b := h.buf
	if h.useBuf && h.handle != nil {
		h.handle = nil // it aliases b
	}
	h.buf, h.useBuf = nil, false
	return b
}
