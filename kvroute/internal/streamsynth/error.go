package streamsynth

import (
	"errors"
	"fmt"
	"io"
	"net/http"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// ErrorEvent renders err, a failure of the given HTTP status, as the SSE
// event that ends a broken stream of one API. The router passes its own
// (the router's Response.ErrorEvent with the path bound and sequence number 0),
// so that errors it shapes and errors the engine shaped look the same to
// clients.
type ErrorEvent func(status int, err error) []byte

// WriteError writes the decode engine's error answer (its HTTP status and
// body, already stripped of kv_transfer_params) to w as the event that
// ends a stream of the API, and flushes w. It is for a router that has
// already sent the stream's headers (keep-alives while it waited, see
// KeepAlive): before that, the engine's status and body go to the client
// as they are, as they would for a streaming request that failed before
// its first event.
//
// The engine's own body becomes the event when it has the API's error
// shape, as vLLM turns an error into a stream's event: on chat and
// completions OpenAI's {"error": {...}} as a data event (an older vLLM's
// {"object": "error", ...} wrapped in "error"); on Messages Anthropic's
// {"type": "error", "error": {...}} as an error event. Any other body
// goes to fallback with an error carrying the body's message when it has
// one (error.message or message), else the status text. A nil fallback
// writes OpenAI's or Anthropic's error shape with a generic type.
func (a API) WriteError(w io.Writer, status int, body []byte, fallback ErrorEvent) error {
	if _, ok := ForPath(a.String()); !ok {
		return fmt.Errorf("streamsynth: %v has no synthesizer", a)
	}
	o := newOut(w)
	obj, err := jsonraw.Parse(body)
	shaped := false
	if err == nil {
		switch a {
		case ChatCompletions, Completions:
			if e, ok := obj.Get("error"); ok && len(e) > 0 && e[0] == '{' {
				o.s("data: ")
				o.raw(body)
				o.s("\n\n")
				shaped = true
			} else if v, ok := obj.Get("object"); ok && string(v) == `"error"` {
				o.s(`data: {"error":`)
				o.raw(body)
				o.s("}\n\n")
				shaped = true
			}
		case Messages:
			e, ok := obj.Get("error")
			if t, _ := obj.Get("type"); ok && string(t) == `"error"` && len(e) > 0 && e[0] == '{' {
				o.s("event: error\ndata: ")
				o.raw(body)
				o.s("\n\n")
				shaped = true
			}
		}
	}
	if !shaped {
		msg := http.StatusText(status)
		if err == nil {
			msg = errorMessage(obj, msg)
		}
		if fallback == nil {
			fallback = a.defaultError
		}
		_, _ = o.w.Write(fallback(status, errors.New(msg)))
	}
	if err := o.flush(); err != nil {
		return err
	}
	return Flush(w)
}

// errorMessage is the message of an error body: error.message, or
// message, or def.
func errorMessage(obj jsonraw.Object, def string) string {
	if e, ok := obj.Get("error"); ok {
		if m, ok := jsonraw.Lookup(e, "message"); ok {
			if s, ok := jsonraw.String(m); ok && s != "" {
				return s
			}
		}
	}
	if m, ok := obj.Get("message"); ok {
		if s, ok := jsonraw.String(m); ok && s != "" {
			return s
		}
	}
	return def
}

// defaultError is the fallback without a router's: OpenAI's error shape
// as a data event, or Anthropic's as an error event.
func (a API) defaultError(status int, err error) []byte {
	msg := jsonraw.AppendQuote(nil, err.Error())
	if a == Messages {
		typ := "api_error"
		if status == http.StatusBadRequest || status == http.StatusUnprocessableEntity {
			typ = "invalid_request_error"
		}
		b := append([]byte(`event: error`+"\n"+`data: {"type":"error","error":{"type":"`), typ...)
		b = append(b, `","message":`...)
		b = append(b, msg...)
		return append(b, "}}\n\n"...)
	}
	typ := "server_error"
	if status/100 == 4 {
		typ = "invalid_request_error"
	}
	b := append([]byte(`data: {"error":{"message":`), msg...)
	b = append(b, `,"type":"`...)
	b = append(b, typ...)
	b = append(b, `","param":null,"code":`...)
	b = fmt.Appendf(b, "%d", status)
	return append(b, "}}\n\n"...)
}
