package kvroute

import (
	"math"
	"strconv"
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// Request flags are read the way vLLM's request models read them: pydantic
// v2 in lax mode (pydantic-core's str_as_bool, int_as_bool, str_as_int and
// float_as_int), so that the router and the engine agree on what a request
// asks for. A value pydantic rejects is reported as not ok; callers decide
// whether that means a 400 or a refusal.

// lenientBool reads a JSON value as a pydantic v2 lax bool: true and false;
// the integers 0 and 1; a number with no fractional part equal to 0 or 1
// (0.0, 1.0, 1e0); and the strings "0" and "1" and, ignoring ASCII case,
// "f", "n", "no", "off", "false", "t", "y", "on", "yes", "true". Strings
// are not trimmed (" true" is rejected, as pydantic does). null and
// anything else are not ok.
func lenientBool(v []byte) (value, ok bool) {
	if b, ok := jsonraw.Bool(v); ok {
		return b, true
	}
	if len(v) == 0 {
		return false, false
	}
	if v[0] == '"' {
		s, ok := jsonraw.String(v)
		if !ok {
			return false, false
		}
		return strBool(s)
	}
	n, ok := numberInt(v)
	if !ok || (n != 0 && n != 1) {
		return false, false
	}
	return n == 1, true
}

// strBool is pydantic-core's str_as_bool.
func strBool(s string) (value, ok bool) {
	switch s {
	case "0":
		return false, true
	case "1":
		return true, true
	}
	for _, f := range [...]string{"f", "n", "no", "off", "false"} {
		if asciiEqualFold(s, f) {
			return false, true
		}
	}
	for _, t := range [...]string{"t", "y", "on", "yes", "true"} {
		if asciiEqualFold(s, t) {
			return true, true
		}
	}
	return false, false
}

// asciiEqualFold compares s with the lower-case ASCII word w, folding only
// ASCII letters (as Rust's eq_ignore_ascii_case: "yeſ" is not "yes").
func asciiEqualFold(s, w string) bool {
	if len(s) != len(w) {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		if 'A' <= c && c <= 'Z' {
			c += 'a' - 'A'
		}
		if c != w[i] {
			return false
		}
	}
	return true
}

// lenientInt reads a JSON value as a pydantic v2 lax int: an integer; a
// number with no fractional part (5.0, 5e0); true and false (1 and 0); or
// a string holding an integer, with surrounding whitespace, a leading '+'
// or '-', leading zeros, single underscores between digits ("1_000") and a
// fraction of zeros ("5.00") allowed. Values outside int64 and anything
// else (null, "5e0", "5.", "1.5", 1.5) are not ok.
func lenientInt(v []byte) (int64, bool) {
	if len(v) == 0 {
		return 0, false
	}
	switch v[0] {
	case 't', 'f':
		b, ok := jsonraw.Bool(v)
		if !ok {
			return 0, false
		}
		if b {
			return 1, true
		}
		return 0, true
	case '"':
		s, ok := jsonraw.String(v)
		if !ok {
			return 0, false
		}
		return strInt(s)
	}
	return numberInt(v)
}

// numberInt reads a JSON number whose value is an integer (pydantic's
// float_as_int for numbers that are not integer literals).
func numberInt(v []byte) (int64, bool) {
	if n, ok := jsonraw.Int(v); ok {
		return n, true
	}
	if len(v) == 0 || !(v[0] == '-' || ('0' <= v[0] && v[0] <= '9')) {
		return 0, false
	}
	f, err := strconv.ParseFloat(string(v), 64)
	if err != nil || math.IsInf(f, 0) || math.IsNaN(f) || f != math.Trunc(f) {
		return 0, false
	}
	if f <= math.MinInt64 || f >= math.MaxInt64 {
		return 0, false
	}
	return int64(f), true
}

// strInt is pydantic-core's str_as_int (clean_int_str) for values that fit
// in an int64.
func strInt(s string) (int64, bool) {
	s = strings.TrimSpace(s)
	neg := false
	if rest, ok := strings.CutPrefix(s, "+"); ok {
		s = rest
		if strings.HasPrefix(s, "-") {
			return 0, false
		}
	}
	if rest, ok := strings.CutPrefix(s, "-"); ok {
		s, neg = rest, true
	}
	// A fraction of zeros ("5.00") is dropped; any other fraction is not
	// an integer.
	if i := strings.IndexByte(s, '.'); i >= 0 {
		frac := s[i+1:]
		if frac == "" || strings.Trim(frac, "0") != "" {
			return 0, false
		}
		s = s[:i]
	}
	if s == "" || s[0] == '_' || s[len(s)-1] == '_' || strings.Contains(s, "__") {
		return 0, false
	}
	digits := make([]byte, 0, len(s)+1)
	if neg {
		digits = append(digits, '-')
	}
	for i := 0; i < len(s); i++ {
		switch c := s[i]; {
		case '0' <= c && c <= '9':
			digits = append(digits, c)
		case c == '_':
		default:
			return 0, false
		}
	}
	n, err := strconv.ParseInt(string(digits), 10, 64)
	if err != nil {
		return 0, false
	}
	return n, true
}

// flagTrue reports whether the request sets the boolean flag key to a
// value other than false: absent and null read as false, a value that
// pydantic would not read as a bool as true, so that a caller refusing on
// true also refuses what it cannot read.
func flagTrue(req *Request, key string) bool {
	v, ok := req.Field(key)
	if !ok || jsonraw.IsNull(v) {
		return false
	}
	b, ok := lenientBool(v)
	return b || !ok
}
