// Package capture inspects a decode engine's stream events on their way
// to the client, one capture per API shape: Chunks for the chunk streams
// of chat and completions, Typed for the named events of Responses and
// Messages. Each removes every kv_transfer_params (through sse's
// scrubber), keeps the decode handle and reassembles the reply; Chunks also
// collects and strips token ids.
package capture

import (
	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

// Stream is the capture of one decode stream.
type Stream interface {
	// Forward returns the bytes to send in place of ev, or an error when
	// ev may hold a handle that cannot be removed safely.
	Forward(ev sse.Event) ([]byte, error)
	// Done reports whether the stream's final event was seen.
	Done() bool
	// Handle returns the decode handle seen, nil when none.
	Handle() []byte
	// HandleBlocks returns where Handle's block list is, when the event's
	// parse read it (kvhandle.ResetAnswer), else the zero Known.
	HandleBlocks() jsonraw.Known
	// Reply returns the reply reassembled so far.
	Reply() *Reply
	// IDs returns the prompt's and the generated token ids, ok when the
	// engine sent both.
	IDs() (prompt, generated []uint32, ok bool)
	// Usage returns the raw JSON of the last usage member of the OpenAI
	// shape seen (prompt_tokens, prompt_tokens_details), nil when none.
	Usage() []byte
}

var (
	_ Stream = (*Chunks)(nil)
	_ Stream = (*Typed)(nil)
)
