package kvroute

import (
	"crypto/sha256"
	"encoding/hex"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// Reply is what the decode engine produced in a turn, reassembled from the
// stream or taken from the body. Identifiers use it to key the retained
// handle on the conversation as the next request will send it.
type Reply struct {
	// Content is the assistant message content (chat) or the generated text
	// (completions).
	Content string
	// ToolCalls is the assistant message's tool_calls as a JSON array in
	// OpenAI's message shape, nil when there are none.
	ToolCalls []byte
	// Reasoning is reasoning_content (or reasoning) output, empty when none.
	Reasoning string
	// FinishReason is choice 0's finish_reason ("stop", "length", ...).
	FinishReason string
	// StopReason is vLLM's stop_reason of choice 0 as raw JSON (null for
	// end of sequence, a number for a stop token, a string for a stop
	// string), nil when the engine sent none.
	StopReason []byte
	// Incomplete is set when the reply could not be reassembled exactly
	// (tool-call fragments that do not fit together, a cut stream).
	Incomplete bool
}

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
type Identifier interface {
	Lookup(req *Request) ([]string, error)
	Key(req *Request, reply *Reply) (Retention, error)
	Verify(req *Request, check []byte) bool
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
	Refusal string
}

// TenantFunc returns the scope of a request's retained handles. Requests
// with different scopes never share a handle. It must not return secrets
// in clear: return a digest.
type TenantFunc func(req *Request) string

// AuthorizationTenant scopes handles by a digest of the inbound
// Authorization header plus the body's cache_salt. It is the default.
func AuthorizationTenant(req *Request) string {
	h := sha256.New()
	h.Write([]byte(req.Header.Get("Authorization")))
	h.Write([]byte{0})
	if v, ok := req.Field("cache_salt"); ok {
		h.Write(v)
	}
	return hex.EncodeToString(h.Sum(nil)[:16])
}

// Tenant returns the request's tenant scope, as computed by the router's
// TenantFunc.
func (r *Request) Tenant() string { return r.tenant }

// ExplicitID identifies a conversation by a client-chosen id: the body
// field conversation_id, else the X-Session-ID header, scoped by tenant.
// Requests with neither are never reused. It trusts the client to send the
// history unchanged; ContinuationKeys does not need that trust.
type ExplicitID struct{}

// Lookup returns the key for the request's conversation id, if any.
func (ExplicitID) Lookup(req *Request) ([]string, error) {
	if k := explicitKey(req); k != "" {
		return []string{k}, nil
	}
	return nil, nil
}

// Key returns the same key as Lookup.
func (ExplicitID) Key(req *Request, _ *Reply) (Retention, error) {
	if k := explicitKey(req); k != "" {
		return Retention{Key: k}, nil
	}
	return Retention{Refusal: "no_conversation_id"}, nil
}

// Verify accepts every handle: ExplicitID trusts the client.
func (ExplicitID) Verify(*Request, []byte) bool { return true }

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
