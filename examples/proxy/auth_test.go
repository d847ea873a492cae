package main

import (
	"net/http"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/bidikv/bidikv/kvroute"
)

// FuzzAuthenticate builds requests whose credentials are known by
// construction (which key, in which header, with what spacing and scheme
// case, beside what else) and checks the proxy's verdict against them: a
// request is admitted exactly when every key it carries is the same
// accepted key, and its principal is then that key's, whichever header
// carried it.
func FuzzAuthenticate(f *testing.F) {
	f.Add(uint8(1), uint8(0), uint8(2), uint8(1), " \t", "sk-guess", uint8(0))
	f.Add(uint8(1), uint8(1), uint8(1), uint8(0), "", "", uint8(5))
	f.Add(uint8(3), uint8(2), uint8(1), uint8(1), "  ", "sk-a", uint8(1))
	keys := []string{"sk-a", "sk-b"}
	s := &server{}
	for _, k := range keys {
		s.keys = append(s.keys, newInboundKey(k))
	}
	f.Fuzz(func(t *testing.T, k1, h1, k2, h2 uint8, pad, junk string, casing uint8) {
		pad = strings.Map(func(r rune) rune {
			if r == ' ' || r == '\t' {
				return r
			}
			return -1
		}, pad)
		if strings.ContainsAny(junk, "\r\n") {
			return
		}
		scheme := []byte("Bearer")
		for i := range scheme {
			if casing>>i&1 == 1 {
				scheme[i] ^= 0x20
			}
		}
		h := http.Header{}
		var carried []string // the keys the proxy must consider, trimmed
		add := func(k, where uint8) {
			var key string
			switch k % 4 {
			case 0:
				return
			case 1, 2:
				key = keys[k%4-1]
			case 3:
				key = junk
			}
			switch where % 3 {
			case 0:
				h.Add("Authorization", string(scheme)+" "+pad+key+pad)
			case 1:
				h.Add("X-Api-Key", pad+key+pad)
			case 2:
				h.Add("Authorization", "Basic "+key) // not the proxy's scheme: ignored
				return
			}
			if tk := strings.Trim(key, " \t"); tk != "" {
				carried = append(carried, tk)
			}
		}
		add(k1, h1)
		add(k2, h2)
		p, ok := s.authenticate(h)
		want := len(carried) > 0
		for _, c := range carried {
			want = want && (c == keys[0] || c == keys[1]) && c == carried[0]
		}
		if !assert.Equal(t, want, ok, "%q", h) || !ok {
			return
		}
		assert.Equal(t, kvroute.KeyPrincipal(carried[0]), p, "%q", h)
	})
}
