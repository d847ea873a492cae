package kvroute_test

import (
	"net/http"
	"strings"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func hdr(kv ...string) http.Header {
	h := http.Header{}
	for i := 0; i+1 < len(kv); i += 2 {
		h[kv[i]] = append(h[kv[i]], kv[i+1]) // as sent: no canonicalisation
	}
	return h
}

// The principal is the credential, whichever header carried it and
// however its scheme is spelled; different credentials never share one.
func TestHeaderPrincipal(t *testing.T) {
	keyA := kvroute.KeyPrincipal("sk-a")
	keyB := kvroute.KeyPrincipal("sk-b")
	require.NotEqual(t, keyA, keyB)
	require.Len(t, keyA, 32)
	same := []struct {
		name string
		h    http.Header
	}{
		{"bearer", hdr("Authorization", "Bearer sk-a")},
		{"lowercase scheme", hdr("Authorization", "bearer sk-a")},
		{"uppercase scheme", hdr("Authorization", "BEARER sk-a")},
		{"extra spaces", hdr("Authorization", "  Bearer   sk-a  ")},
		{"tab", hdr("Authorization", "Bearer\tsk-a")},
		{"x-api-key", hdr("X-Api-Key", "sk-a")},
		{"x-api-key lowercase name", hdr("x-api-key", " sk-a ")},
		{"both headers, one key", hdr("Authorization", "Bearer sk-a", "X-Api-Key", "sk-a")},
		{"duplicate header, one key", hdr("X-Api-Key", "sk-a", "X-Api-Key", "sk-a")},
		{"empty values beside it", hdr("X-Api-Key", "", "Authorization", "Bearer sk-a", "Authorization", " ")},
		{"bearer without token beside it", hdr("Authorization", "Bearer", "X-Api-Key", "sk-a")},
	}
	for _, tc := range same {
		assert.Equal(t, keyA, kvroute.HeaderPrincipalForTest(tc.h), tc.name)
	}
	distinct := map[string]http.Header{
		"none":               {},
		"key b":              hdr("X-Api-Key", "sk-b"),
		"key of other case":  hdr("X-Api-Key", "SK-A"),
		"a and b":            hdr("Authorization", "Bearer sk-a", "X-Api-Key", "sk-b"),
		"b and a":            hdr("X-Api-Key", "sk-b", "X-Api-Key", "sk-a", "X-Api-Key", "sk-c"),
		"basic":              hdr("Authorization", "Basic c2stYQ=="),
		"other scheme":       hdr("Authorization", "Token sk-a"),
		"no scheme":          hdr("Authorization", "sk-a"),
		"no scheme, case":    hdr("Authorization", "SK-A"),
		"cookie is not read": hdr("Cookie", "session=sk-a"),
	}
	seen := map[string]string{keyA: "key a"}
	for name, h := range distinct {
		p := kvroute.HeaderPrincipalForTest(h)
		if name == "none" || name == "cookie is not read" {
			assert.Empty(t, p, name)
			continue
		}
		if name == "key b" {
			assert.Equal(t, keyB, p)
		}
		prev, dup := seen[p]
		assert.False(t, dup, "%s has the principal of %s", name, prev)
		seen[p] = name
	}
	assert.Equal(t, kvroute.HeaderPrincipalForTest(hdr("Authorization", "Bearer sk-a", "X-Api-Key", "sk-b")),
		kvroute.HeaderPrincipalForTest(hdr("X-Api-Key", "sk-b", "Authorization", "bearer sk-a")), "order does not matter")
	assert.Equal(t, kvroute.HeaderPrincipalForTest(hdr("Authorization", "Basic x")),
		kvroute.HeaderPrincipalForTest(hdr("Authorization", "basic x")), "the scheme is case-insensitive")
}

// Tenant B resending tenant A's exact history never reuses A's KV, whichever
// header carries the keys (Anthropic's SDKs and Claude Code send X-Api-Key,
// OpenAI's SDKs Authorization: Bearer); A itself hits with either header.
// A TenantFunc sees the same principal, and a principal in the context
// (ContextWithPrincipal, from an authenticating layer) wins over headers.
func TestTenantIsThePrincipal(t *testing.T) {
	c := kvroutetest.NewCluster(t, 1, 1)
	var mu sync.Mutex
	seen := map[string]string{} // X-Request-Id -> principal the TenantFunc saw
	r := newRouter(t, c, kvroute.WithTenant(func(req *kvroute.Request) string {
		mu.Lock()
		seen[req.Header.Get("X-Request-Id")] = req.Principal()
		mu.Unlock()
		return kvroute.PrincipalTenant(req)
	}))
	// An authenticating layer: X-User names a user whose principal it sets.
	url := newServer(t, leakGuard{t: t, h: http.HandlerFunc(func(w http.ResponseWriter, hr *http.Request) {
		if u := hr.Header.Get("X-User"); u != "" {
			hr = hr.WithContext(kvroute.ContextWithPrincipal(hr.Context(), kvroute.KeyPrincipal("user:"+u)))
		}
		r.ServeHTTP(w, hr)
	})})
	for i, tc := range []struct {
		name       string
		a1, b, a2  http.Header
		principalA string
	}{
		{"x-api-key", hdr("X-Api-Key", "sk-a"), hdr("X-Api-Key", "sk-b"), hdr("X-Api-Key", "sk-a"), kvroute.KeyPrincipal("sk-a")},
		{"bearer then x-api-key", hdr("Authorization", "Bearer sk-a"), hdr("X-Api-Key", "sk-b"), hdr("X-Api-Key", "sk-a"), kvroute.KeyPrincipal("sk-a")},
		{"x-api-key then lowercase bearer", hdr("X-Api-Key", "sk-a"), hdr("Authorization", "bearer sk-b"), hdr("Authorization", "bearer sk-a"), kvroute.KeyPrincipal("sk-a")},
		{"b adds a's key as a second credential", hdr("X-Api-Key", "sk-a"), hdr("X-Api-Key", "sk-b", "Authorization", "Bearer sk-a"), hdr("X-Api-Key", "sk-a"), kvroute.KeyPrincipal("sk-a")},
		{"context principal over headers", hdr("X-User", "alice", "X-Api-Key", "shared"), hdr("X-User", "bob", "X-Api-Key", "shared"), hdr("X-User", "alice"), kvroute.KeyPrincipal("user:alice")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			conv := &conversation{path: kvroute.PathChatCompletions, maxTok: 12,
				messages: []message{{Role: "system", Content: systemPrompt}}}
			conv.say(userText(i))
			with := func(h http.Header, id string) http.Header {
				h = h.Clone()
				h.Set("X-Request-Id", id)
				return h
			}
			id := func(s string) string { return tc.name + "/" + s }
			res := post(t, url, conv.path, conv.body(), with(tc.a1, id("a1")))
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			assert.Equal(t, "miss", res.header.Get("X-Bidikv-Reuse"))
			conv.hear(res.text)
			conv.say(userText(i + 100))

			res = post(t, url, conv.path, conv.body(), with(tc.b, id("b")))
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			assert.Equal(t, "miss", res.header.Get("X-Bidikv-Reuse"), "another tenant never reuses a's KV")
			assert.Equal(t, reference(t, conv.path, conv.body()), res.text)

			res = post(t, url, conv.path, conv.body(), with(tc.a2, id("a2")))
			require.Equal(t, http.StatusOK, res.status, "%s", res.raw)
			assert.Equal(t, "hit", res.header.Get("X-Bidikv-Reuse"), "a's own key, by either header, is a's tenant")
			assert.Equal(t, reference(t, conv.path, conv.body()), res.text)

			mu.Lock()
			defer mu.Unlock()
			assert.Equal(t, tc.principalA, seen[id("a1")], "the TenantFunc sees the principal")
			assert.Equal(t, tc.principalA, seen[id("a2")])
			assert.NotEqual(t, tc.principalA, seen[id("b")])
		})
	}
	for _, e := range append(c.Prefill, c.Decode...) {
		for _, rec := range e.Requests() {
			for _, h := range []string{"Authorization", "X-Api-Key", "Cookie"} {
				assert.Empty(t, rec.Header.Values(h), "%s never reaches an engine", h)
			}
		}
	}
}

// FuzzHeaderPrincipal checks the principal against an oracle: a key is the
// same principal as X-Api-Key and as a Bearer token of any scheme case
// (KeyPrincipal), two different keys are two principals, and a request
// carrying both is neither.
func FuzzHeaderPrincipal(f *testing.F) {
	f.Add("sk-a", "sk-b", uint8(0))
	f.Add(" sk-a\t", "sk-a", uint8(3))
	f.Add("", "Bearer", uint8(1))
	f.Add("a b", "a  b", uint8(6))
	f.Fuzz(func(t *testing.T, k1, k2 string, casing uint8) {
		scheme := []byte("Bearer")
		for i := range scheme {
			if casing>>i&1 == 1 {
				scheme[i] ^= 0x20 // flip the letter's case
			}
		}
		trim := func(s string) string { return strings.Trim(s, " \t") }
		t1, t2 := trim(k1), trim(k2)
		p1 := kvroute.HeaderPrincipalForTest(hdr("X-Api-Key", k1))
		p1b := kvroute.HeaderPrincipalForTest(hdr("Authorization", string(scheme)+" "+k1))
		if t1 == "" {
			assert.Empty(t, p1)
			assert.Empty(t, p1b)
			return
		}
		assert.Equal(t, kvroute.KeyPrincipal(k1), p1)
		assert.Equal(t, p1, p1b, "the same key by either header")
		if t2 == "" {
			assert.Equal(t, p1, kvroute.HeaderPrincipalForTest(hdr("X-Api-Key", k1, "X-Api-Key", k2)), "an empty value does not count")
			return
		}
		p2 := kvroute.HeaderPrincipalForTest(hdr("Authorization", string(scheme)+" "+k2))
		both := kvroute.HeaderPrincipalForTest(hdr("X-Api-Key", k1, "Authorization", "Bearer "+k2))
		if t1 == t2 {
			assert.Equal(t, p1, p2)
			assert.Equal(t, p1, both)
			return
		}
		assert.NotEqual(t, p1, p2, "two keys, two principals")
		assert.NotEqual(t, p1, both)
		assert.NotEqual(t, p2, both)
	})
}
