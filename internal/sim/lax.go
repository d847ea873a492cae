package sim

import (
	"bytes"
	"encoding/json"
	"math"
	"strconv"
	"strings"
)

// Lax-mode scalar parsing as pydantic v2 does it for vLLM's request models.

// nullable lists the fields typed "X | None": JSON null means the default.
// Other fields reject null, as pydantic does for a plain bool or int.
var nullableFields = map[string]bool{
	"stream": true, "return_token_ids": true, "include_usage": true, "continuous_usage_stats": true,
	"max_tokens": true, "max_completion_tokens": true, "n": true, "truncate_prompt_tokens": true,
	"return_token_strs": true, "logprobs": true, "top_logprobs": true,
}

// laxBool reads a boolean field: JSON true/false, the numbers 0 and 1 (0.0
// and 1.0 too), or one of the strings "0", "off", "f", "false", "n", "no",
// "1", "on", "t", "true", "y", "yes" in any case. def when absent.
func laxBool(m map[string]json.RawMessage, key string, def bool) (bool, error) {
	raw, ok := m[key]
	if !ok {
		return def, nil
	}
	raw = bytes.TrimSpace(raw)
	if bytes.Equal(raw, []byte("null")) {
		if nullableFields[key] {
			return def, nil
		}
		return false, badRequest("%s: Input should be a valid boolean", key)
	}
	var v any
	if err := json.Unmarshal(raw, &v); err != nil {
		return false, badRequest("%s: Input should be a valid boolean", key)
	}
	switch x := v.(type) {
	case bool:
		return x, nil
	case float64:
		switch x {
		case 0:
			return false, nil
		case 1:
			return true, nil
		}
	case string:
		switch strings.ToLower(x) {
		case "0", "off", "f", "false", "n", "no":
			return false, nil
		case "1", "on", "t", "true", "y", "yes":
			return true, nil
		}
		return false, badRequest("%s: Input should be a valid boolean, unable to interpret input", key)
	}
	return false, badRequest("%s: Input should be a valid boolean", key)
}

// laxIntPtr reads an integer field: a JSON integer, a float with no
// fractional part (5.0), a string holding an integer ("5", " 5 ", "5.0"), or
// a boolean (1 or 0), as pydantic's lax int does. ok is false
// when the field is absent (or null, for nullable fields).
func laxIntPtr(m map[string]json.RawMessage, key string) (n int, ok bool, err error) {
	raw, present := m[key]
	if !present {
		return 0, false, nil
	}
	raw = bytes.TrimSpace(raw)
	if bytes.Equal(raw, []byte("null")) {
		if nullableFields[key] {
			return 0, false, nil
		}
		return 0, false, badRequest("%s: Input should be a valid integer", key)
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	var v any
	if err := dec.Decode(&v); err != nil {
		return 0, false, badRequest("%s: Input should be a valid integer", key)
	}
	switch x := v.(type) {
	case bool:
		if x {
			return 1, true, nil
		}
		return 0, true, nil
	case json.Number:
		if i, err := strconv.ParseInt(string(x), 10, 64); err == nil {
			return int(i), true, nil
		}
		f, err := strconv.ParseFloat(string(x), 64)
		if err != nil || math.IsInf(f, 0) {
			return 0, false, badRequest("%s: Input should be a valid integer", key)
		}
		if f != math.Trunc(f) {
			return 0, false, badRequest("%s: Input should be a valid integer, got a number with a fractional part", key)
		}
		return int(f), true, nil
	case string:
		s := strings.TrimSpace(x)
		if i, err := strconv.ParseInt(s, 10, 64); err == nil {
			return int(i), true, nil
		}
		// pydantic accepts trailing decimal zeros ("5.0", "5.00")
		if j := strings.IndexByte(s, '.'); j > 0 && strings.Trim(s[j+1:], "0") == "" {
			if i, err := strconv.ParseInt(s[:j], 10, 64); err == nil {
				return int(i), true, nil
			}
		}
		return 0, false, badRequest("%s: Input should be a valid integer, unable to parse string as an integer", key)
	}
	return 0, false, badRequest("%s: Input should be a valid integer", key)
}

// laxInt is laxIntPtr with a default.
func laxInt(m map[string]json.RawMessage, key string, def int) (int, error) {
	n, ok, err := laxIntPtr(m, key)
	if err != nil || !ok {
		return def, err
	}
	return n, nil
}

// laxString reads a string field strictly (pydantic v2 does not coerce
// numbers to strings); absent or null leaves *dst unchanged.
func laxString(m map[string]json.RawMessage, key string, dst *string) error {
	raw, ok := m[key]
	if !ok || !present(raw) {
		return nil
	}
	if err := json.Unmarshal(raw, dst); err != nil {
		return badRequest("%s: Input should be a valid string", key)
	}
	return nil
}
