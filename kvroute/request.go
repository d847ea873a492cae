package kvroute

import (
	"net/http"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// The routes a Router serves.
const (
	PathChatCompletions = "/v1/chat/completions"
	PathCompletions     = "/v1/completions"
)

// Request is one turn as the client sent it.
type Request struct {
	// Path is PathChatCompletions or PathCompletions.
	Path string
	// Header holds the client's headers. The router reads X-Request-Id,
	// X-Session-ID and Authorization (for the tenant; never forwarded) and
	// forwards end-to-end headers other than Authorization to both legs.
	Header http.Header
	// Body is the client's JSON body. Do does not modify it.
	Body []byte

	obj    jsonraw.Object
	parsed bool
	tenant string

	// chain is ContinuationKeys' digest of the whole conversation, kept
	// from Lookup so that Key hashes only the reply.
	chain   [32]byte
	chained bool
	// bounds are the digests of every prefix of the messages that ends
	// with an assistant message, but the last message.
	bounds [][32]byte
}

// Field returns the raw JSON of a top-level member of the request body, as
// the client sent it; ok is false when the member is absent or the body is
// not a JSON object. The body is indexed once, on first use.
func (r *Request) Field(key string) (value []byte, ok bool) {
	if !r.parsed {
		r.parsed = true
		r.obj, _ = jsonraw.Parse(r.Body)
	}
	return r.obj.Get(key)
}

// Chat reports whether the request is a chat completion.
func (r *Request) Chat() bool { return r.Path == PathChatCompletions }

// parse validates the request and indexes its body.
func (r *Request) parse() error {
	if r.Path != PathChatCompletions && r.Path != PathCompletions {
		return badRequest("unsupported path %q; use %s or %s", r.Path, PathChatCompletions, PathCompletions)
	}
	obj, err := jsonraw.Parse(r.Body)
	if err != nil {
		return badRequest("request body is not a JSON object: %v", err)
	}
	r.obj, r.parsed, r.chained = obj, true, false
	if v, ok := obj.Get("model"); ok {
		if _, isStr := jsonraw.String(v); !isStr {
			return badRequest("model must be a string")
		}
	}
	if r.Chat() {
		v, ok := obj.Get("messages")
		if !ok || len(v) == 0 || v[0] != '[' {
			return badRequest("messages must be a non-empty array")
		}
		n := 0
		if err := jsonraw.Elements(v, func(m []byte) error {
			if len(m) == 0 || m[0] != '{' {
				return badRequest("messages[%d] must be an object", n)
			}
			n++
			return nil
		}); err != nil {
			return err
		}
		if n == 0 {
			return badRequest("messages must be a non-empty array")
		}
	} else if v, ok := obj.Get("prompt"); !ok || jsonraw.IsNull(v) {
		return badRequest("prompt is required")
	}
	if v, ok := obj.Get("stream"); ok && !jsonraw.IsNull(v) {
		if _, isBool := lenientBool(v); !isBool {
			return badRequest(`stream must be a boolean: true or false, 0 or 1, or one of the strings "true", "false", "1", "0", "yes", "no", "on", "off", "t", "f", "y", "n"`)
		}
	}
	return nil
}

// Streaming reports whether the client asked for a stream. stream is read
// as vLLM reads it (pydantic's lax bool: 1 and "true" are true); absent,
// null and a value that is not a boolean (which parse refuses) are false.
func (r *Request) Streaming() bool {
	v, ok := r.Field("stream")
	if !ok {
		return false
	}
	b, _ := lenientBool(v)
	return b
}
