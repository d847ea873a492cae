package kvroute

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"net/http"
	"slices"
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
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

// read is the turn's first phase: it validates the request and fixes what
// the phases after it read of the client (whether it streams, its
// principal, its tenant, its conversation hint).
func read(ctx context.Context, t *turn) error {
	req := t.req
	if err := req.parse(t.r.cfg.maxMembers); err != nil {
		return err
	}
	t.stream = req.streaming()
	t.rec.Stream = t.stream
	req.setPrincipal(ctx)
	req.tenant = t.r.tenant(req)
	req.hint = conversationHint(req)
	return nil
}

// Reply is the engine's answer to a turn as the Identifier sees it, one
// shape from the stream's capture to the Identifier: choice 0's content
// (chat) or text (completions) as Content, Reasoning, ToolCalls (a JSON
// array of OpenAI tool calls, nil when none), FinishReason, StopReason
// (vLLM's stop_reason as raw JSON, nil when none) and Incomplete (the
// reply could not be reassembled), read from the body or the stream.
// Migration: it was an alias of sse.Reply, which moved into kvroute.
type Reply = capture.Reply

// Identifier maps turns to retention keys. It is a public seam
// (ARCHITECTURE.md, Seams), given with WithIdentifier; ContinuationKeys
// is the default.
//
// Lookup runs before the prefill leg and returns the keys under which a
// handle that the request may continue is stored, most specific first; the
// router takes the first one present and verifies it: by tokens in
// VerifyTokens mode when the handle has a token fingerprint, else by asking
// Verify whether the request really continues what was stored. A handle
// that fails verification is put back. Key runs when the decode engine
// finished the turn normally and says where to retain its handle. Keys are
// opaque strings and are never trusted: what they name is verified before
// use. Verify must return true only when the request continues what the
// handle holds: one that accepts any handle lets a prompt pull another
// conversation's KV as its prefix, which answers wrongly and leaves those
// blocks in the prefill engine's prefix cache under that prompt's tokens,
// where every tenant that sends the prompt reads them. Implementations must still scope them by req.Tenant() so tenants
// never share a handle. Implementations are called concurrently.
//
// The Candidates that Lookup returned are handed back to Verify and Key in
// the same turn, so an Identifier can keep what it computed (a digest of
// the conversation) in Candidates.Memo instead of computing it again. When
// the router did not call Lookup (reuse off), Key receives the zero
// Candidates.
type Identifier interface {
	Lookup(req *Request) (Candidates, error)
	Key(req *Request, c Candidates, reply *Reply) (Retention, error)
	Verify(req *Request, c Candidates, check []byte) bool
}

// Candidates is what Identifier.Lookup found for a request.
type Candidates struct {
	// Keys are the store keys to try, most specific first.
	Keys []string
	// Memo is the Identifier's own state for this turn; the router only
	// carries it from Lookup to Verify and Key.
	Memo any
}

// Retention says where to retain a finished turn's handle.
type Retention struct {
	// Key is the store key; "" retains nothing.
	Key string
	// Check is kept with the handle and given to Verify on the next turn.
	Check []byte
	// Refusal says why the turn must not be reused under content rules.
	// With Key "" nothing is retained (a hard refusal). With a Key (a soft
	// refusal), the router retains the handle only when it also holds the
	// engine's token fingerprint, and then uses it only after token
	// verification, never on Verify alone.
	Refusal Refusal
}

// TenantFunc returns the scope of a request's retained handles. Requests
// with different scopes never share a handle. It must not return secrets
// in clear: return a digest. Scope by req.Principal(), the authenticated
// principal (ContextWithPrincipal, else headerPrincipal), never by a raw
// header: a header the TenantFunc does not read would let every client
// that authenticates with it share one scope.
type TenantFunc func(req *Request) string

// PrincipalTenant scopes handles by the request's principal
// (Request.Principal) plus the body's cache_salt. It is the default.
func PrincipalTenant(req *Request) string {
	h := sha256.New()
	h.Write([]byte("tenant.v2\x00"))
	h.Write([]byte(req.Principal()))
	h.Write([]byte{0})
	if v, ok := req.Field("cache_salt"); ok {
		h.Write(v)
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// Tenant returns the request's tenant scope, as computed by the router's
// TenantFunc.
func (r *Request) Tenant() string { return r.tenant }

// idLookup is Lookup by conversation id: the key for the request's id, if
// any, with the content rules' digest of a chat conversation for Verify.
func (c ContinuationKeys) idLookup(req *Request) (Candidates, error) {
	k := explicitKey(req)
	if k == "" {
		return Candidates{}, nil
	}
	cands := Candidates{Keys: []string{k}}
	if req.Path == PathChatCompletions {
		if d, err := c.content().Lookup(req); err == nil {
			cands.Memo = d.Memo
		}
	}
	return cands, nil
}

// idKey is Key by conversation id: the same key as idLookup, with the
// content rules' check and refusal for the finished turn: a turn they
// refuse outright is not retained.
func (c ContinuationKeys) idKey(req *Request, cands Candidates, reply *Reply) (Retention, error) {
	k := explicitKey(req)
	if k == "" {
		return Retention{Refusal: RefuseNoConversationID}, nil
	}
	ret, err := c.content().Key(req, cands, reply)
	if err != nil || ret.Key == "" {
		return ret, err
	}
	ret.Key = k
	return ret, nil
}

// content is c keying by content.
func (c ContinuationKeys) content() ContinuationKeys {
	c.ByConversationID = false
	return c
}

func explicitKey(req *Request) string {
	id := conversationHint(req)
	if id == "" {
		return ""
	}
	sum := sha256.Sum256([]byte("id\x00" + req.Tenant() + "\x00" + id))
	return "id:" + hex.EncodeToString(sum[:])
}

// conversationHint returns a client-supplied conversation id: the body
// field conversation_id, else session_id, else prompt_cache_key, else the
// X-Session-ID header; "" when none. It places turns (Selection.Hint) and,
// with ContinuationKeys.ByConversationID, keys them; it never unlocks a
// handle.
func conversationHint(req *Request) string {
	for _, k := range [...]string{"conversation_id", "session_id", "prompt_cache_key"} {
		if v, ok := req.Field(k); ok {
			if s, ok := jsonraw.String(v); ok && s != "" {
				return s
			}
		}
	}
	return req.Header.Get(headerSessionID)
}

const (
	headerSessionID = "X-Session-Id"
	headerRequestID = "X-Request-Id"
	headerReuse     = "X-Bidikv-Reuse"
)

// The principal: who is asking, as one place decides it. Tenant scopes,
// and so every retention key, derive from it (PrincipalTenant), never
// from a raw header.
//
// An authenticating layer in front of the Router (the proxy's API keys,
// an embedder's middleware) knows best: it puts the principal it
// authenticated in the request's context with ContextWithPrincipal, for
// example KeyPrincipal of the key it matched. Without one, the principal
// is derived from the credentials the request carries (headerPrincipal):
// the same result for the same key whichever header carried it, different
// keys give different principals, and no credential at all gives "".

type principalKey struct{}

// ContextWithPrincipal returns a copy of ctx that carries principal, the
// authenticated identity of the requests run in it: Router.Do (and so
// ServeHTTP, which runs Do in the request's context) takes it as
// Request.Principal instead of deriving one from the request's headers.
// Call it where the request is authenticated, with a digest (such as
// KeyPrincipal of the matched key), never a secret in clear. "" is a
// principal too: every request so marked shares one tenant scope.
func ContextWithPrincipal(ctx context.Context, principal string) context.Context {
	return context.WithValue(ctx, principalKey{}, principal)
}

// principalFrom returns the principal ctx carries, if any.
func principalFrom(ctx context.Context) (string, bool) {
	p, ok := ctx.Value(principalKey{}).(string)
	return p, ok
}

// Principal returns the request's principal: the one its context carried
// into Router.Do (ContextWithPrincipal), else headerPrincipal of its
// headers. A TenantFunc and an Identifier see the same value; it is a
// digest, never a credential.
func (r *Request) Principal() string {
	if !r.principalSet {
		r.principal, r.principalSet = headerPrincipal(r.Header), true
	}
	return r.principal
}

// setPrincipal fixes the request's principal for a turn run in ctx.
func (r *Request) setPrincipal(ctx context.Context) {
	if p, ok := principalFrom(ctx); ok {
		r.principal, r.principalSet = p, true
		return
	}
	r.principal, r.principalSet = headerPrincipal(r.Header), true
}

// headerPrincipal returns the principal named by the credentials in h: a
// digest of every value of Authorization and X-Api-Key, "" when there is
// none. A Bearer token (the scheme in any case, RFC 7235) and an X-Api-Key
// value are the same credential, an API key, so a key gives the same
// principal whichever header carries it (KeyPrincipal); another scheme is
// a credential of that scheme, and a value without a scheme one of its
// own. Surrounding spaces and empty values do not count, and a key sent
// twice counts once; two different credentials give a principal of their
// own, which is neither's. Cookies are not read: a layer that
// authenticates by cookie sets the principal itself (ContextWithPrincipal).
func headerPrincipal(h http.Header) string {
	var buf [4]string
	creds := buf[:0]
	for k, vs := range h {
		switch {
		case strings.EqualFold(k, "Authorization"):
			for _, v := range vs {
				if c := authorizationCredential(v); c != "" {
					creds = append(creds, c)
				}
			}
		case strings.EqualFold(k, "X-Api-Key"):
			for _, v := range vs {
				if v = trimOWS(v); v != "" {
					creds = append(creds, apiKeyTag+v)
				}
			}
		}
	}
	if len(creds) == 0 {
		return ""
	}
	slices.Sort(creds)
	return principalDigest(slices.Compact(creds))
}

// KeyPrincipal returns the principal of an API key: what headerPrincipal
// gives for a request whose only credential is that key, sent as
// Authorization: Bearer KEY or X-Api-Key: KEY. An authenticating layer
// that matched key passes it to ContextWithPrincipal.
func KeyPrincipal(key string) string {
	return principalDigest([]string{apiKeyTag + trimOWS(key)})
}

// Tags of the credentials headerPrincipal digests: an API key (Bearer
// token or X-Api-Key), an Authorization value of another scheme, one
// without a scheme.
const (
	apiKeyTag = "key\x00"
	schemeTag = "scheme\x00"
	rawTag    = "raw\x00"
)

// authorizationCredential returns the tagged credential of one
// Authorization value: "scheme SP credentials" with the scheme's case
// folded (RFC 7235: it is case-insensitive) and the credentials as sent.
func authorizationCredential(v string) string {
	v = trimOWS(v)
	if v == "" {
		return ""
	}
	i := strings.IndexAny(v, " \t")
	switch {
	case i < 0 && strings.EqualFold(v, "Bearer"):
		return "" // a scheme without its token
	case i < 0:
		return rawTag + v
	}
	scheme, cred := v[:i], trimOWS(v[i:])
	if strings.EqualFold(scheme, "Bearer") {
		if cred == "" {
			return ""
		}
		return apiKeyTag + cred
	}
	return schemeTag + strings.ToLower(scheme) + "\x00" + cred
}

// trimOWS removes HTTP's optional whitespace (spaces and tabs) around s.
func trimOWS(s string) string { return strings.Trim(s, " \t") }

// principalDigest hashes sorted, distinct tagged credentials: 128 bits
// of SHA-256, in hex.
func principalDigest(creds []string) string {
	h := sha256.New()
	h.Write([]byte("bidikv principal v1\x00"))
	var n [binary.MaxVarintLen64]byte
	for _, c := range creds {
		h.Write(n[:binary.PutUvarint(n[:], uint64(len(c)))])
		h.Write([]byte(c))
	}
	var sum [sha256.Size]byte
	return hex.EncodeToString(h.Sum(sum[:0])[:16])
}
