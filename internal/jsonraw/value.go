package jsonraw

import (
	"bytes"
	"strconv"
	"unicode/utf16"
	"unicode/utf8"
)

// IsNull reports whether v is the literal null.
func IsNull(v []byte) bool { return string(v) == "null" }

// Bool returns the value of the literal true or false; ok is false for any
// other input.
func Bool(v []byte) (b, ok bool) {
	switch string(v) {
	case "true":
		return true, true
	case "false":
		return false, true
	}
	return false, false
}

// Int returns the value of an integer number literal (an optional minus
// sign and digits, no fraction or exponent) that fits in an int64, as
// encoding/json does when decoding into an int64.
func Int(v []byte) (int64, bool) {
	if len(v) == 0 {
		return 0, false
	}
	digits := v
	if digits[0] == '-' {
		digits = digits[1:]
	}
	if len(digits) == 0 || (digits[0] == '0' && len(digits) > 1) {
		return 0, false
	}
	for _, c := range digits {
		if !isDigit(c) {
			return 0, false
		}
	}
	n, err := strconv.ParseInt(string(v), 10, 64)
	if err != nil {
		return 0, false
	}
	return n, true
}

// String decodes a JSON string value. ok is false if v is not a well-formed
// JSON string. Invalid UTF-8 and unpaired surrogate escapes decode to U+FFFD,
// as with encoding/json.
func String(v []byte) (string, bool) {
	s := scanner{data: v}
	if len(v) == 0 || v[0] != '"' {
		return "", false
	}
	end, escaped, err := s.str(0)
	if err != nil || end != len(v) {
		return "", false
	}
	inner := v[1 : len(v)-1]
	if !escaped && utf8.Valid(inner) {
		return string(inner), true
	}
	return string(unquote(make([]byte, 0, len(inner)), v)), true
}

// StringBytes decodes the JSON string v without copying when it can: a
// string without escapes whose bytes are valid UTF-8 is returned as v's own
// bytes between the quotes (aliasing v); any other is decoded into
// buf[:0], grown as needed. buf is returned for reuse (grown, or as given).
// ok is false if v is not a well-formed JSON string.
func StringBytes(v, buf []byte) (s, scratch []byte, ok bool) {
	sc := scanner{data: v}
	if len(v) == 0 || v[0] != '"' {
		return nil, buf, false
	}
	end, escaped, err := sc.str(0)
	if err != nil || end != len(v) {
		return nil, buf, false
	}
	inner := v[1 : len(v)-1 : len(v)-1]
	if !escaped && utf8.Valid(inner) {
		return inner, buf, true
	}
	buf = unquote(buf[:0], v)
	return buf, buf, true
}

// StringPieces decodes the JSON string v piece by piece without building
// it: fn receives, in order, runs of v's own bytes that need no decoding and
// the decoding of each escape or invalid byte (a piece is valid only during
// the call). Their concatenation is what String returns. ok is false (and fn
// is not called) if v is not a well-formed JSON string.
func StringPieces(v []byte, fn func(piece []byte)) bool {
	if len(v) == 0 || v[0] != '"' {
		return false
	}
	sc := scanner{data: v}
	end, _, err := sc.str(0)
	if err != nil || end != len(v) {
		return false
	}
	return stringPieces(v, fn)
}

// StringPiecesTrusted is StringPieces for a string taken from a parsed
// Object or array (Parse, Reset, Elements, Members), whose form was
// checked when the document was: it does not check it again, which halves
// the passes over a long string. On other input it never panics, but it
// may pass fn pieces that are not a decoding, or return false after
// calling fn.
func StringPiecesTrusted(v []byte, fn func(piece []byte)) bool {
	if len(v) < 2 || v[0] != '"' || v[len(v)-1] != '"' {
		return false
	}
	return stringPieces(v, fn)
}

// stringPieces decodes the quoted string v into fn; false on an escape cut
// short (which a checked string never has).
func stringPieces(v []byte, fn func(piece []byte)) bool {
	var tmp [utf8.UTFMax]byte
	emitRune := func(r rune) { fn(tmp[:utf8.EncodeRune(tmp[:], r)]) }
	s := v[1 : len(v)-1]
	for len(s) > 0 {
		i := bytes.IndexByte(s, '\\')
		if i < 0 {
			i = len(s)
		}
		validPieces(s[:i], fn, emitRune)
		s = s[i:]
		if len(s) == 0 {
			break
		}
		if len(s) < 2 {
			return false
		}
		switch c := s[1]; c {
		case 'b':
			emitRune('\b')
		case 'f':
			emitRune('\f')
		case 'n':
			emitRune('\n')
		case 'r':
			emitRune('\r')
		case 't':
			emitRune('\t')
		case 'u':
			r := getu4(s)
			if r < 0 {
				return false
			}
			s = s[6:]
			if utf16.IsSurrogate(r) {
				if r2 := getu4(s); r2 >= 0 {
					if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
						emitRune(dec)
						s = s[6:]
						continue
					}
				}
				r = utf8.RuneError
			}
			emitRune(r)
			continue
		default: // '"', '\\', '/'
			emitRune(rune(c))
		}
		s = s[2:]
	}
	return true
}

// validPieces passes b to fn, with each byte of an invalid UTF-8 sequence
// replaced by U+FFFD (as appendValidUTF8).
func validPieces(b []byte, fn func([]byte), emitRune func(rune)) {
	if len(b) == 0 {
		return
	}
	if utf8.Valid(b) {
		fn(b)
		return
	}
	for len(b) > 0 {
		i := 0
		for i < len(b) && b[i] < utf8.RuneSelf {
			i++
		}
		if i > 0 {
			fn(b[:i])
		}
		b = b[i:]
		if len(b) == 0 {
			break
		}
		r, size := utf8.DecodeRune(b)
		if r == utf8.RuneError && size == 1 {
			emitRune(utf8.RuneError)
		} else {
			fn(b[:size])
		}
		b = b[size:]
	}
}

// AppendString appends the decoded JSON string v to dst, like String but
// without allocating a string. ok is false if v is not a well-formed JSON
// string (dst is then returned unchanged).
func AppendString(dst, v []byte) ([]byte, bool) {
	s := scanner{data: v}
	if len(v) == 0 || v[0] != '"' {
		return dst, false
	}
	end, _, err := s.str(0)
	if err != nil || end != len(v) {
		return dst, false
	}
	return unquote(dst, v), true
}

// unquote appends the decoding of the quoted string q (normally validated)
// to dst. It never panics on malformed input.
func unquote(dst, q []byte) []byte {
	s := q[1 : len(q)-1]
	for len(s) > 0 {
		i := bytes.IndexByte(s, '\\')
		if i < 0 {
			i = len(s)
		}
		dst = appendValidUTF8(dst, s[:i])
		s = s[i:]
		if len(s) == 0 {
			break
		}
		// s[0] == '\\'. The input is normally validated; malformed escapes
		// (possible through the trusting walkers) decode to U+FFFD.
		if len(s) < 2 {
			dst = utf8.AppendRune(dst, utf8.RuneError)
			break
		}
		switch c := s[1]; c {
		case 'b':
			dst = append(dst, '\b')
		case 'f':
			dst = append(dst, '\f')
		case 'n':
			dst = append(dst, '\n')
		case 'r':
			dst = append(dst, '\r')
		case 't':
			dst = append(dst, '\t')
		case 'u':
			r := getu4(s)
			if r < 0 {
				dst = utf8.AppendRune(dst, utf8.RuneError)
				s = s[2:]
				continue
			}
			s = s[6:]
			if utf16.IsSurrogate(r) {
				if r2 := getu4(s); r2 >= 0 {
					if dec := utf16.DecodeRune(r, r2); dec != utf8.RuneError {
						dst = utf8.AppendRune(dst, dec)
						s = s[6:]
						continue
					}
				}
				r = utf8.RuneError
			}
			dst = utf8.AppendRune(dst, r)
			continue
		case '"', '\\', '/':
			dst = append(dst, c)
		default:
			dst = utf8.AppendRune(dst, utf8.RuneError)
		}
		s = s[2:]
	}
	return dst
}

// getu4 decodes a \uXXXX escape at the start of s, or returns -1.
func getu4(s []byte) rune {
	if len(s) < 6 || s[0] != '\\' || s[1] != 'u' {
		return -1
	}
	var r rune
	for _, c := range s[2:6] {
		switch {
		case '0' <= c && c <= '9':
			c -= '0'
		case 'a' <= c && c <= 'f':
			c = c - 'a' + 10
		case 'A' <= c && c <= 'F':
			c = c - 'A' + 10
		default:
			return -1
		}
		r = r*16 + rune(c)
	}
	return r
}

// appendValidUTF8 appends b to dst, replacing each byte of an invalid UTF-8
// sequence with U+FFFD.
func appendValidUTF8(dst, b []byte) []byte {
	if utf8.Valid(b) {
		return append(dst, b...)
	}
	for len(b) > 0 {
		i := 0
		for i < len(b) && b[i] < utf8.RuneSelf {
			i++
		}
		dst = append(dst, b[:i]...)
		b = b[i:]
		if len(b) == 0 {
			break
		}
		r, size := utf8.DecodeRune(b)
		if r == utf8.RuneError && size == 1 {
			dst = utf8.AppendRune(dst, utf8.RuneError)
		} else {
			dst = append(dst, b[:size]...)
		}
		b = b[size:]
	}
	return dst
}

// AppendQuote appends s to dst as a JSON string, escaping as encoding/json
// does except that '<', '>' and '&' are left alone. Invalid UTF-8 is written
// as \ufffd.
func AppendQuote(dst []byte, s string) []byte {
	const hex = "0123456789abcdef"
	dst = append(dst, '"')
	start := 0
	for i := 0; i < len(s); {
		c := s[i]
		if c < utf8.RuneSelf {
			if c >= 0x20 && c != '"' && c != '\\' {
				i++
				continue
			}
			dst = append(dst, s[start:i]...)
			switch c {
			case '"', '\\':
				dst = append(dst, '\\', c)
			case '\n':
				dst = append(dst, '\\', 'n')
			case '\r':
				dst = append(dst, '\\', 'r')
			case '\t':
				dst = append(dst, '\\', 't')
			default:
				dst = append(dst, '\\', 'u', '0', '0', hex[c>>4], hex[c&0xf])
			}
			i++
			start = i
			continue
		}
		r, size := utf8.DecodeRuneInString(s[i:])
		if r == utf8.RuneError && size == 1 {
			dst = append(dst, s[start:i]...)
			dst = append(dst, `\ufffd`...)
			i++
			start = i
			continue
		}
		if r == '\u2028' || r == '\u2029' {
			dst = append(dst, s[start:i]...)
			dst = append(dst, '\\', 'u', '2', '0', '2', hex[r&0xf])
			i += size
			start = i
			continue
		}
		i += size
	}
	dst = append(dst, s[start:]...)
	return append(dst, '"')
}
