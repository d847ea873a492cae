package jsonraw

import (
	"errors"
	"strconv"
)

// ErrNotObject is returned by Parse for a valid JSON document whose top-level
// value is not an object.
var ErrNotObject = errors.New("jsonraw: top-level value is not an object")

// maxDepth is the nesting limit of encoding/json's scanner; deeper documents
// are rejected as they are by json.Valid.
const maxDepth = 10000

// SyntaxError reports malformed JSON and the byte offset where it was found.
type SyntaxError struct {
	// Offset is the index of the offending byte in the input (len(input) when
	// the input ended too early).
	Offset int
	// Msg describes the problem.
	Msg string
}

// Error implements error.
func (e *SyntaxError) Error() string {
	return "jsonraw: " + e.Msg + " at offset " + strconv.Itoa(e.Offset)
}

func syntaxErr(off int, msg string) error {
	return &SyntaxError{Offset: off, Msg: msg}
}
