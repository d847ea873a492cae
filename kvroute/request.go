package kvroute

import (
	"errors"
	"net/http"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/convkey"
)

// The routes a Router serves (PathResponses and PathMessages are with
// their APIs, api_responses.go and api_messages.go).
const (
	PathChatCompletions = "/v1/chat/completions"
	PathCompletions     = "/v1/completions"
)

// Request is one turn as the client sent it.
type Request struct {
	// Path is PathChatCompletions, PathCompletions, PathResponses or
	// PathMessages (a query string, such as Claude Code's ?beta=true, is
	// not part of it).
	Path string
	// Header holds the client's headers. The router reads X-Request-Id,
	// X-Session-ID, and Authorization and X-Api-Key for the principal
	// unless the context carries one (Principal). It forwards end-to-end
	// headers to both legs except the client's credentials (Authorization,
	// X-Api-Key, Cookie, Proxy-Authorization: transport.RequestHeader);
	// with a Tracer, its trace headers replace the client's (WithTracer).
	Header http.Header
	// Body is the client's JSON body. Do does not modify it. ServeHTTP
	// reads it into a buffer the Router reuses after the turn, so an
	// Identifier, Selector, TenantFunc or Observer must not keep Body (or
	// a slice of it) beyond its call.
	Body []byte
	// ref counts the users of Body when the Router owns its buffer
	// (ServeHTTP); nil otherwise.
	ref *bodyRef

	obj    jsonraw.Object
	parsed bool
	tenant string
	hint   string // conversationHint, for placement only
	api    *api

	// principal is Principal's value once principalSet: from the
	// context of Do (ContextWithPrincipal), else from the headers.
	principal    string
	principalSet bool

	// keys is the digest state the request's keys and anchors reuse
	// (ContinuationKeys): a Request is not safe for concurrent use (Field
	// parses lazily), and so neither is this.
	keys convkey.Scratch
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

// parse validates the request and indexes its body, whose objects may
// have at most maxMembers members each (WithLimits' ObjectMembers).
func (r *Request) parse(maxMembers int) error {
	a, ok := apiFor(r.Path)
	if !ok {
		return badRequest("unsupported path %q; use %s, %s, %s or %s", r.Path, PathChatCompletions, PathCompletions, PathResponses, PathMessages)
	}
	r.api = a
	obj, err := jsonraw.ParseLimited(r.Body, maxMembers)
	if errors.Is(err, jsonraw.ErrTooManyMembers) {
		return badRequest("request body has an object with more than %d members (WithMaxObjectMembers)", maxMembers)
	}
	if err != nil {
		return badRequest("request body is not a JSON object: %v", err)
	}
	r.obj, r.parsed = obj, true
	if v, ok := obj.Get("model"); ok {
		if _, isStr := jsonraw.String(v); !isStr {
			return badRequest("model must be a string")
		}
	}
	if err := a.impl.validate(obj); err != nil {
		return err
	}
	if v, ok := obj.Get("stream"); ok && !jsonraw.IsNull(v) {
		if _, isBool := lenientBool(v); !isBool {
			return badRequest(`stream must be a boolean: true or false, 0 or 1, or one of the strings "true", "false", "1", "0", "yes", "no", "on", "off", "t", "f", "y", "n"`)
		}
	}
	return nil
}

// streaming reports whether the client asked for a stream. stream is read
// as vLLM reads it (pydantic's lax bool: 1 and "true" are true); absent,
// null and a value that is not a boolean (which parse refuses) are false.
func (r *Request) streaming() bool {
	v, ok := r.Field("stream")
	if !ok {
		return false
	}
	b, _ := lenientBool(v)
	return b
}

// model returns the body's model, "" when it names none.
func (r *Request) model() string {
	v, _ := r.Field("model")
	s, _ := jsonraw.String(v)
	return s
}
