package streamsynth

import (
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// API is an HTTP API whose non-streaming answers can be written as its
// stream.
type API uint8

// The APIs with a synthesizer. The Responses API has none: its streams
// carry the decode handle on response.completed (vLLM PR #37424), so the
// router never buffers them.
const (
	// ChatCompletions is POST /v1/chat/completions: chat.completion.chunk
	// events ending in data: [DONE].
	ChatCompletions API = iota + 1
	// Completions is POST /v1/completions: text_completion chunks ending
	// in data: [DONE].
	Completions
	// Messages is Anthropic's POST /v1/messages: named events from
	// message_start to message_stop.
	Messages
)

// Paths of the APIs, as kvroute serves them.
const (
	PathChatCompletions = "/v1/chat/completions"
	PathCompletions     = "/v1/completions"
	PathMessages        = "/v1/messages"
)

// ForPath returns the API served at path, ok false when it has no
// synthesizer (the Responses API among them).
func ForPath(path string) (a API, ok bool) {
	switch path {
	case PathChatCompletions:
		return ChatCompletions, true
	case PathCompletions:
		return Completions, true
	case PathMessages:
		return Messages, true
	}
	return 0, false
}

// String returns the API's path.
func (a API) String() string {
	switch a {
	case ChatCompletions:
		return PathChatCompletions
	case Completions:
		return PathCompletions
	case Messages:
		return PathMessages
	}
	return fmt.Sprintf("streamsynth.API(%d)", uint8(a))
}

// Options is what the client asked for that shapes the stream but is not
// in the answer body. The number of choices (n), logprobs and token ids
// are read from the body itself. The zero Options is a request without
// stream_options: no usage chunk.
type Options struct {
	// IncludeUsage is stream_options.include_usage (chat and completions):
	// a last chunk with "choices": [] and the body's usage before
	// data: [DONE]. Messages streams always carry usage.
	IncludeUsage bool
	// ContinuousUsage is stream_options.continuous_usage_stats (a vLLM
	// extension): usage on every chunk. The first chunk of each choice
	// counts the prompt only; every later chunk carries the body's usage,
	// which is exact for one choice (the content leaves in one chunk) and
	// the total of all choices for n > 1.
	ContinuousUsage bool
}

// ErrMalformed is returned, before anything is written, for an answer
// body that is not a JSON object of the API's answer shape: a field the
// stream carries as text (content, reasoning, a tool call's name or
// arguments, a block's text or thinking) that is not a string, choices or
// content blocks that are not objects, and so on.
var ErrMalformed = errors.New("streamsynth: not an answer of the API")

// Write writes body, the decode engine's non-streaming answer (already
// stripped of kv_transfer_params), to w as the stream the engine sends
// for the same answer, and flushes w. It validates the whole body first:
// on ErrMalformed nothing is written. Any other error is w's.
//
// w should be the client's response with its headers set (SetHeader);
// the events are assembled in a 4 KiB buffer (or in w itself when it is a
// *bufio.Writer at least that large) and every long value (content,
// reasoning, arguments, logprobs) goes from body to w without a copy, so
// the answer is held once, in body. After the last event w is flushed
// (http.NewResponseController(w).Flush when w is an http.ResponseWriter).
func (a API) Write(w io.Writer, body []byte, opt Options) error {
	obj, err := jsonraw.Parse(body)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrMalformed, err)
	}
	switch a {
	case ChatCompletions:
		err = writeChat(w, obj, opt)
	case Completions:
		err = writeCompletions(w, obj, opt)
	case Messages:
		err = writeMessages(w, obj)
	default:
		return fmt.Errorf("streamsynth: %v has no synthesizer", a)
	}
	if err != nil {
		return err
	}
	return Flush(w)
}

// SetHeader sets the headers of a synthesized stream on h, as vLLM sends
// them for a stream: Content-Type text/event-stream; charset=utf-8, and no
// Content-Length or Content-Encoding (the non-streaming answer's own no
// longer apply).
func SetHeader(h http.Header) {
	h.Set("Content-Type", "text/event-stream; charset=utf-8")
	h.Del("Content-Length")
	h.Del("Content-Encoding")
}

// KeepAlive is an SSE comment, which every client's parser skips (the
// OpenAI and Anthropic SDKs included): a router that commits the stream's
// headers before the answer arrives can write it while it waits, so that
// idle timeouts between client and router do not cut the turn.
const KeepAlive = ": keep-alive\n\n"

// Flush flushes w when it can be flushed: an http.ResponseWriter through
// its ResponseController, a writer with Flush() error or an http.Flusher;
// a writer that cannot be flushed is not an error.
func Flush(w io.Writer) error {
	var err error
	switch f := w.(type) {
	case http.ResponseWriter:
		err = http.NewResponseController(f).Flush()
	case interface{ Flush() error }:
		err = f.Flush()
	case http.Flusher:
		f.Flush()
	}
	if errors.Is(err, http.ErrNotSupported) {
		return nil
	}
	return err
}
