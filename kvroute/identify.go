package kvroute

import (
	"crypto/sha256"
	"encoding/hex"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/sse"
)

// Reply is the engine's answer to a turn as the Identifier sees it:
// choice 0's content (chat) or text (completions), tool calls, reasoning,
// finish and stop reasons, reassembled from the body or the stream. It is
// the same type as sse.Reply, so a reply has one shape from the stream
// parser to the Identifier.
type Reply = sse.Reply

// Identifier maps turns to retention keys.
//
// Lookup runs before the prefill leg and returns the keys under which a
// handle that the request may continue is stored, most specific first; the
// router takes the first one present and verifies it: by tokens in
// VerifyTokens mode when the handle has a token fingerprint, else by asking
// Verify whether the request really continues what was stored. A handle
// that fails verification is put back. Key runs when the decode engine
// finished the turn normally and says where to retain its handle. Keys are
// opaque strings and are never trusted: what they name is verified before
// use. Implementations must still scope them by req.Tenant() so tenants
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
// principal (ContextWithPrincipal, else HeaderPrincipal), never by a raw
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

// AuthorizationTenant is PrincipalTenant.
//
// Deprecated: it once digested the Authorization header alone, so every
// client that sent its key as X-Api-Key shared one scope; it now scopes by
// Request.Principal, as PrincipalTenant, which new code should name.
func AuthorizationTenant(req *Request) string { return PrincipalTenant(req) }

// Tenant returns the request's tenant scope, as computed by the router's
// TenantFunc.
func (r *Request) Tenant() string { return r.tenant }

// ExplicitID identifies a conversation by a client-chosen id: the body
// field conversation_id, else the X-Session-ID header, scoped by tenant.
// Requests with neither are never reused. It trusts the client to send the
// history unchanged; ContinuationKeys does not need that trust.
type ExplicitID struct{}

// Lookup returns the key for the request's conversation id, if any.
func (ExplicitID) Lookup(req *Request) (Candidates, error) {
	if k := explicitKey(req); k != "" {
		return Candidates{Keys: []string{k}}, nil
	}
	return Candidates{}, nil
}

// Key returns the same key as Lookup.
func (ExplicitID) Key(req *Request, _ Candidates, _ *Reply) (Retention, error) {
	if k := explicitKey(req); k != "" {
		return Retention{Key: k}, nil
	}
	return Retention{Refusal: RefuseNoConversationID}, nil
}

// Verify accepts every handle: ExplicitID trusts the client.
func (ExplicitID) Verify(*Request, Candidates, []byte) bool { return true }

func explicitKey(req *Request) string {
	id := ConversationHint(req)
	if id == "" {
		return ""
	}
	sum := sha256.Sum256([]byte("id\x00" + req.Tenant() + "\x00" + id))
	return "id:" + hex.EncodeToString(sum[:])
}

// ConversationHint returns a client-supplied conversation id: the body
// field conversation_id, else session_id, else prompt_cache_key, else the
// X-Session-ID header; "" when none.
func ConversationHint(req *Request) string {
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
