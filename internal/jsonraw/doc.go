// Package jsonraw edits the top-level members of a JSON object held as bytes
// without decoding it, and walks arrays and objects at any depth.
//
// Every byte that an edit does not touch is copied verbatim: numbers keep
// their exact spelling, keys keep their order and escapes, and whitespace is
// preserved. Keys are always compared after unescaping, so
// "kv\u005ftransfer_params" and "kv_transfer_params" name the same member.
//
// Parsing validates the whole document in a single pass with the grammar of
// RFC 8259, accepting exactly what encoding/json's Valid accepts (including
// its nesting limit and its tolerance of invalid UTF-8 inside strings, which
// the value helpers decode to U+FFFD as encoding/json does). Values returned
// by this package alias the parsed input; the input must not be modified
// while they are in use.
package jsonraw
