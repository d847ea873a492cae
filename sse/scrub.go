package sse

import (
	"bytes"
	"errors"
	"fmt"
	"slices"
	"unicode/utf8"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// The one mechanism every byte of an engine's answer goes through on its
// way to a client: Scrub for JSON (a body, an event's data), ScrubEvent for
// a stream event. It decides on the decoded structure, never on the
// spelling: a member whose decoded name is kv_transfer_params is removed
// at any depth; a member named as only a handle's members are
// (handleOnly), anywhere else, makes the answer fail closed, as does
// anything that is not JSON where JSON is due.

// HandleKey is the top-level member of an engine's response that carries
// its KV handle.
const HandleKey = "kv_transfer_params"

// ErrMalformedData is returned by Scrub, ScrubEvent and ScrubValidEvent for
// data that may hide a KV handle: it is not valid JSON, or it holds a
// member only handles have outside kv_transfer_params. Such data must not
// be forwarded.
var ErrMalformedData = errors.New("sse: malformed event data may carry a KV handle")

// handleOnly are the members only a KV handle has. Outside a
// kv_transfer_params member they mean an engine put (part of) a handle
// where none belongs: such an answer is never forwarded. The handle's
// remote_host, remote_port, tp_size and transfer_mode are left out: a
// model's tool call may well have arguments with those names, and without
// the members above they address no blocks.
var handleOnly = []string{
	"do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id",
	"remote_request_id", "remote_num_tokens", "remote_blocks_expiry_time",
}

// decideHandle is Scrub's verdict on a member named key.
func decideHandle(key []byte) jsonraw.Verdict {
	if string(key) == HandleKey {
		return jsonraw.Cut
	}
	for _, m := range handleOnly {
		if string(key) == m {
			return jsonraw.Refuse
		}
	}
	return jsonraw.Keep
}

// MayHoldHandle is Scrub's prefilter for JSON text b: false means no
// member of b can be named kv_transfer_params or a member only handles
// have, however it is spelled. A name decodes to one of them only if it is
// spelled literally (each contains kv_transfer_params or remote_) or with
// a \u escape (no other JSON escape yields a letter, a digit or '_';
// invalid UTF-8 decodes to U+FFFD).
func MayHoldHandle(b []byte) bool {
	return bytes.Contains(b, []byte(HandleKey)) || bytes.Contains(b, []byte("remote_")) || bytes.Contains(b, []byte(`\u`))
}

// Scrub returns JSON text data (an engine's body, or an event's data) as it
// may reach a client: every member whose decoded name is
// kv_transfer_params, at any depth and whatever its spelling (escapes,
// duplicates), removed with its comma, and every other byte as it was;
// changed reports a removal, in which case out is appended to dst. It
// returns ErrMalformedData when data is not valid JSON (RFC 8259, as
// encoding/json reads it: compressed or truncated bytes, a byte order mark,
// trailing data) or holds, outside every kv_transfer_params member, a
// member named as only a handle's members are (remote_block_ids,
// remote_engine_id, remote_request_id, remote_num_tokens,
// remote_blocks_expiry_time, do_remote_decode, do_remote_prefill): such
// answers may hide a handle and are never forwarded. Numbers of any size
// and invalid UTF-8 inside strings pass as they are (conforming decoders
// read the latter as U+FFFD, which spells no member name).
func Scrub(dst, data []byte) (out []byte, changed bool, err error) {
	return scrub(dst, data, false)
}

// scrub is Scrub for data already validated as JSON when valid is set.
func scrub(dst, data []byte, valid bool) ([]byte, bool, error) {
	if !MayHoldHandle(data) {
		if !valid && !jsonraw.Valid(data) {
			return nil, false, fmt.Errorf("%w: not JSON", ErrMalformedData)
		}
		return data, false, nil
	}
	prune := jsonraw.Prune
	if valid {
		prune = jsonraw.PruneValid // validated once already: not again
	}
	out, changed, err := prune(dst, data, decideHandle)
	switch {
	case errors.Is(err, jsonraw.ErrRefused):
		return nil, false, fmt.Errorf("%w: a handle's member outside kv_transfer_params", ErrMalformedData)
	case err != nil:
		return nil, false, fmt.Errorf("%w: not JSON", ErrMalformedData)
	}
	return out, changed, nil
}

// ScrubEvent returns the bytes to forward for e, an event a Reader
// returned, whose data the caller may have edited into data (edited says
// so; data is e.Data otherwise). It applies Scrub to the data (the
// "[DONE]" of chat and completions streams and empty data pass as they
// are; anything else that is not JSON is an error), then keeps of e's other lines only what a client reads and
// cannot hold a handle: comments and event, id and retry fields that are
// text (valid UTF-8 without control characters) naming no handle member
// and holding no backslash. Other lines are dropped with their line
// breaks: lines that name a handle, that are not text, and every field a
// client ignores (unknown names, a byte order mark that does not start
// the stream, which the SSE specification reads as part of the name but
// some clients strip).
//
// The result is e.Raw itself when nothing changed; otherwise, appended to
// dst (rewritten true), e with the dropped lines gone and, when the data
// changed, its data lines replaced by one "data: " line holding it (line
// breaks between JSON tokens become spaces) at the place of the first.
// An Incomplete event (the stream ended before the blank line that ends
// it) is never dispatched by a client and never forwarded: ScrubEvent
// returns no bytes for it.
func ScrubEvent(dst []byte, e Event, data []byte, edited bool) (out []byte, rewritten bool, err error) {
	return scrubEvent(dst, e, data, edited, false)
}

// ScrubValidEvent is ScrubEvent for data the caller has already validated
// as JSON (for example by indexing it with its own parser): it skips
// ScrubEvent's validation pass over data that cannot name a handle. Data
// that is not valid JSON must go through ScrubEvent.
func ScrubValidEvent(dst []byte, e Event, data []byte, edited bool) (out []byte, rewritten bool, err error) {
	return scrubEvent(dst, e, data, edited, true)
}

// scrubEvent is ScrubEvent for data already validated when valid is set.
func scrubEvent(dst []byte, e Event, data []byte, edited, valid bool) ([]byte, bool, error) {
	if e.Incomplete {
		return nil, false, nil
	}
	if e.HasData && len(data) > 0 && string(data) != "[DONE]" {
		out, changed, err := scrub(nil, data, valid)
		if err != nil {
			return nil, false, err
		}
		if changed {
			data, edited = out, true
		}
	}
	if !edited && !dropsLine(e) {
		return e.Raw, false, nil
	}
	return reframe(dst, e, data, edited), true, nil
}

// Line kinds, as a client's parser reads a line (ScrubEvent and Reader use
// the same classification).
type lineKind uint8

const (
	lineBlank lineKind = iota
	lineComment
	lineData
	lineEvent
	lineID
	lineRetry
	lineOther // a field a client ignores
)

// classify returns the kind of line (without its line break) and its
// value; a line without a colon is a field whose value is empty.
func classify(line []byte) (lineKind, []byte) {
	if len(line) == 0 {
		return lineBlank, nil
	}
	if line[0] == ':' {
		return lineComment, line[1:]
	}
	name, value := line, line[:0]
	if c := bytes.IndexByte(line, ':'); c >= 0 {
		name, value = line[:c], line[c+1:]
		if len(value) > 0 && value[0] == ' ' {
			value = value[1:]
		}
	}
	switch string(name) {
	case "data":
		return lineData, value
	case "event":
		return lineEvent, value
	case "id":
		return lineID, value
	case "retry":
		return lineRetry, value
	}
	return lineOther, value
}

// keepLine reports whether a line outside the data may be forwarded: a
// comment or a field a client reads, that is text and cannot hold a
// handle.
func keepLine(k lineKind, line []byte) bool {
	if k == lineOther {
		return false
	}
	if namesHandle(line) || bytes.IndexByte(line, '\\') >= 0 || !utf8.Valid(line) {
		return false
	}
	for _, b := range line {
		if b < 0x20 && b != '\t' || b == 0x7f {
			return false
		}
	}
	return true
}

// namesHandle reports whether b names kv_transfer_params or a member only
// handles have (they all contain "remote_").
func namesHandle(b []byte) bool {
	return bytes.Contains(b, []byte(HandleKey)) || bytes.Contains(b, []byte("remote_"))
}

// lines calls fn for each line of e.Raw (without its line break; the
// stream's byte order mark, when e starts with it, left out) with the
// span of the line and its line break; it stops when fn returns false.
func lines(e Event, fn func(line []byte, start, next int) bool) {
	raw, off := e.Raw, 0
	if e.BOM {
		off = len(bom)
	}
	for off < len(raw) {
		end, next := lineEnd(raw[off:])
		if !fn(raw[off:off+end], off, off+next) {
			return
		}
		off += next
	}
}

// dropsLine reports whether ScrubEvent drops a line of e.
func dropsLine(e Event) bool {
	drop := false
	lines(e, func(line []byte, _, _ int) bool {
		k, _ := classify(line)
		if k != lineBlank && k != lineData && !keepLine(k, line) {
			drop = true
		}
		return !drop
	})
	return drop
}

// reframe appends to dst the event e without the lines ScrubEvent drops
// and, when replace is set, with its data lines replaced by one "data: "
// line holding data, at the place of the first data line.
func reframe(dst []byte, e Event, data []byte, replace bool) []byte {
	// One growth of dst, not one per doubling: the new data line and
	// room for the short lines around it, or raw as it is. (Not raw when
	// replacing: raw may be a large event whose data shrank, such as a
	// first chunk whose prompt ids are stripped.)
	if replace {
		dst = slices.Grow(dst, len("data: \n")+len(data)+64)
	} else {
		dst = slices.Grow(dst, len(e.Raw))
	}
	if e.BOM {
		dst = append(dst, bom...)
	}
	wrote := false
	lines(e, func(line []byte, start, next int) bool {
		k, _ := classify(line)
		switch {
		case k == lineData && replace:
			if !wrote {
				wrote = true
				dst = append(dst, "data: "...)
				s := len(dst)
				dst = append(dst, data...)
				for i, b := range dst[s:] {
					if b == '\n' || b == '\r' {
						dst[s+i] = ' '
					}
				}
				dst = append(dst, '\n')
			}
		case k == lineBlank || k == lineData || keepLine(k, line):
			seg := e.Raw[start:next]
			if len(seg) > 0 && seg[0] == '\n' && len(dst) > 0 && dst[len(dst)-1] == '\r' {
				// The line before a dropped one ended in a lone "\r":
				// with this line's "\n" a client would read one CRLF,
				// and the blank line (the event's end) would vanish.
				dst[len(dst)-1] = '\n'
			}
			dst = append(dst, seg...)
		}
		return true
	})
	return dst
}

// NamesHandleMember reports whether the JSON text data has, at any depth, a
// member whose decoded name is kv_transfer_params or one only handles have
// (see Scrub); false when data is not valid JSON. A router uses it on
// requests whose answers echo parts of them (OpenAI's Responses API echoes
// metadata, tools and text): such a member would make every answer fail
// closed.
func NamesHandleMember(data []byte) bool {
	if !MayHoldHandle(data) {
		return false
	}
	_, _, err := jsonraw.Prune(nil, data, func(key []byte) jsonraw.Verdict {
		if string(key) == HandleKey {
			return jsonraw.Refuse
		}
		return decideHandle(key)
	})
	return errors.Is(err, jsonraw.ErrRefused)
}

// lineEnd returns the end of the first line of b and the start of the next.
func lineEnd(b []byte) (end, next int) {
	// Two byte searches, each vectorised, rather than IndexAny's loop:
	// a data line of D's first chunk in token mode is ~166 KB long.
	i := bytes.IndexByte(b, '\n')
	lim := i
	if lim < 0 {
		lim = len(b)
	}
	if j := bytes.IndexByte(b[:lim], '\r'); j >= 0 {
		i = j
	}
	switch {
	case i < 0:
		return len(b), len(b)
	case b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n':
		return i, i + 2
	default:
		return i, i + 1
	}
}
