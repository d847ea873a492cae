package kvroute

import (
	"crypto/sha256"
	"encoding/hex"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
)

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
