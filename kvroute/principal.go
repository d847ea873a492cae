package kvroute

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"net/http"
	"slices"
	"strings"
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
