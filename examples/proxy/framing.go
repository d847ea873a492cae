package main

import (
	"bytes"
	"net/http"
)

// Requests with both Content-Length and Transfer-Encoding. RFC 9112
// section 6.1: such a message "might indicate an attempt to perform
// request smuggling ... and ought to be handled as an error". net/http
// accepts it: Transfer-Encoding: chunked wins and Content-Length is removed
// from the request's headers (net/http's fixLength, transfer.go) before any
// handler runs, so a front proxy that frames by Content-Length and this
// server would read different requests from the same bytes. The proxy
// therefore looks for the pair in the bytes its connections read
// (headerScan), and answers every request of a connection where it saw
// them 400, closing the connection.

// maxHeaderName is the longest header name headerScan matches, with its
// colon.
const maxHeaderName = len("transfer-encoding:")

// headerScan follows the lines a connection reads, in blocks that blank
// lines end (a request's head is one), and notes a block with both a
// Content-Length and a Transfer-Encoding line. It keeps at most
// maxHeaderName bytes of a line. A block in a body counts as well: a
// client whose body holds such raw lines only refuses its own later
// requests (JSON bodies hold no raw line breaks in strings).
type headerScan struct {
	start     [maxHeaderName]byte // the start of the current line
	n         int                 // bytes of it kept
	midLine   bool                // past the kept start of the current line
	length    bool                // the block has a Content-Length line
	transfer  bool                // and a Transfer-Encoding line
	ambiguous bool                // a block had both
}

func (s *headerScan) scan(b []byte) {
	for len(b) > 0 {
		i := bytes.IndexByte(b, '\n')
		if !s.midLine {
			part := b
			if i >= 0 {
				part = b[:i]
			}
			s.n += copy(s.start[s.n:], part)
			if s.n == maxHeaderName && i < 0 {
				s.line()
				s.midLine = true
			}
		}
		if i < 0 {
			return
		}
		if !s.midLine {
			s.line()
		}
		b = b[i+1:]
		s.n, s.midLine = 0, false
	}
}

// line notes the kept start of a line: a header name, or a blank line
// that ends the block.
func (s *headerScan) line() {
	l := s.start[:s.n]
	switch {
	case !s.midLine && (len(l) == 0 || (len(l) == 1 && l[0] == '\r')):
		s.ambiguous = s.ambiguous || (s.length && s.transfer)
		s.length, s.transfer = false, false
	case hasPrefixFold(l, "content-length:"):
		s.length = true
	case hasPrefixFold(l, "transfer-encoding:"):
		s.transfer = true
	}
}

// hasPrefixFold reports whether b starts with prefix (lower case), in any
// ASCII case.
func hasPrefixFold(b []byte, prefix string) bool {
	if len(b) < len(prefix) {
		return false
	}
	for i := range len(prefix) {
		c := b[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != prefix[i] {
			return false
		}
	}
	return true
}

// ambiguousLength answers 400 in the API's error shape, and closes the
// connection, when r's connection read a head with both Content-Length and
// Transfer-Encoding; it reports whether it did.
func (s *server) ambiguousLength(w http.ResponseWriter, r *http.Request) bool {
	cc := connFrom(r.Context())
	if cc == nil || !cc.ambiguous() {
		return false
	}
	w.Header().Set("Connection", "close")
	s.reject(w, r, http.StatusBadRequest, "ambiguous_length",
		"a request with both Content-Length and Transfer-Encoding is refused (RFC 9112 section 6.1: it may smuggle a request)")
	return true
}
