package jsonraw

// Elements calls fn with the raw bytes of each element of the JSON array
// arr, in order. It stops at, and returns, the first error fn returns.
//
// arr must be valid JSON, such as a value taken from a parsed Object: for
// speed the contents of strings are not validated again. Structural errors
// (arr is not an array, brackets or commas are wrong, trailing data) are
// reported as a *SyntaxError; Elements never panics on any input.
func Elements(arr []byte, fn func(v []byte) error) error {
	s := scanner{data: arr, trusted: true}
	i := skipSpace(arr, 0)
	if i >= len(arr) || arr[i] != '[' {
		return s.unexpected(i, "looking for beginning of array")
	}
	end, err := s.array(i, func(valStart, valEnd int) error {
		return fn(arr[valStart:valEnd:valEnd])
	})
	if err != nil {
		return err
	}
	return s.trailing(end)
}

// Members calls fn with the unescaped key and raw value of each member of
// the JSON object obj, in document order (duplicates included). It stops
// at, and returns, the first error fn returns.
//
// obj must be valid JSON, as for Elements; structural errors are reported
// as a *SyntaxError and Members never panics on any input.
func Members(obj []byte, fn func(key string, v []byte) error) error {
	s := scanner{data: obj, trusted: true}
	i := skipSpace(obj, 0)
	if i >= len(obj) || obj[i] != '{' {
		return s.unexpected(i, "looking for beginning of object")
	}
	end, err := s.object(i, func(_, keyStart, keyEnd int, escaped bool, valStart, valEnd, _ int) error {
		var key string
		if needsDecode(obj[keyStart:keyEnd], escaped) {
			key = string(unquote(nil, obj[keyStart:keyEnd]))
		} else {
			key = intern(obj[keyStart+1 : keyEnd-1])
		}
		return fn(key, obj[valStart:valEnd:valEnd])
	})
	if err != nil {
		return err
	}
	return s.trailing(end)
}

// trailing reports an error if anything but whitespace follows index i.
func (s *scanner) trailing(i int) error {
	if j := skipSpace(s.data, i); j < len(s.data) {
		return s.unexpected(j, "after top-level value")
	}
	return nil
}

// Valid reports whether data is a well-formed JSON document; it agrees with
// encoding/json's Valid.
func Valid(data []byte) bool {
	s := scanner{data: data}
	end, err := s.value(skipSpace(data, 0))
	return err == nil && s.trailing(end) == nil
}

// Lookup returns the raw value of the member named key in the JSON object
// obj (last occurrence wins), comparing unescaped keys without allocating
// for keys free of escapes. Like Members it trusts obj to be valid JSON; ok
// is false when the member is absent or obj is not an object.
func Lookup(obj []byte, key string) (value []byte, ok bool) {
	s := scanner{data: obj, trusted: true}
	i := skipSpace(obj, 0)
	if i >= len(obj) || obj[i] != '{' {
		return nil, false
	}
	_, err := s.object(i, func(_, keyStart, keyEnd int, escaped bool, valStart, valEnd, _ int) error {
		if keyEquals(obj[keyStart:keyEnd], escaped, key) {
			value, ok = obj[valStart:valEnd:valEnd], true
		}
		return nil
	})
	if err != nil {
		return nil, false
	}
	return value, ok
}

// keyEquals reports whether the quoted key q decodes to key.
func keyEquals(q []byte, escaped bool, key string) bool {
	if !needsDecode(q, escaped) {
		return string(q[1:len(q)-1]) == key
	}
	var buf [64]byte
	return string(unquote(buf[:0], q)) == key
}
