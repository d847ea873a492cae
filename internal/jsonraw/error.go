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

// ErrTooManyMembers is matched (errors.Is) by the *MembersError of
// ParseLimited.
var ErrTooManyMembers = errors.New("jsonraw: an object has more members than the limit")

// MembersError reports an object with more members than ParseLimited's
// limit, at the byte offset of the first member beyond it.
type MembersError struct {
	Offset int
	Limit  int
}

// Error implements error.
func (e *MembersError) Error() string {
	return "jsonraw: an object has more than " + strconv.Itoa(e.Limit) + " members at offset " + strconv.Itoa(e.Offset)
}

// Unwrap returns ErrTooManyMembers.
func (e *MembersError) Unwrap() error { return ErrTooManyMembers }
