package transport_test

import (
	"testing"

	"github.com/bidikv/bidikv/transport"
)

// FuzzParseEndpoint checks that ParseEndpoint never panics and that what it
// accepts is stable: re-parsing the resulting URL gives the same URL.
func FuzzParseEndpoint(f *testing.F) {
	for _, s := range []string{
		"http://localhost:8000", "[::1]:8100", "http://[::1]:8100/p/", "h:1", "::1",
		"https://[fe80::1%25eth0]:443", "http://u:p@h:1", "http://h:1?x#y", "8000", "",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		e, err := transport.ParseEndpoint(s)
		if err != nil {
			return
		}
		if e.URL == nil || e.URL.Host == "" || e.URL.User != nil || e.URL.RawQuery != "" || e.URL.Fragment != "" {
			t.Fatalf("ParseEndpoint(%q) accepted %#v", s, e.URL)
		}
		again, err := transport.ParseEndpoint(e.URL.String())
		if err != nil {
			t.Fatalf("ParseEndpoint(%q) = %q, which does not re-parse: %v", s, e.URL, err)
		}
		if again.URL.String() != e.URL.String() {
			t.Fatalf("ParseEndpoint(%q) = %q, re-parsed as %q", s, e.URL, again.URL)
		}
		_ = e.JoinPath("/v1/chat/completions").String()
	})
}
