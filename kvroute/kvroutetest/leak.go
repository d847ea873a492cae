package kvroutetest

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"slices"
	"strings"
)

// CheckLeak is the oracle of hostile-engine tests: it returns an error
// naming the first sign of a KV handle in what a client received (the
// response's header and body), or nil. It looks
//
//   - at the headers: a Content-Encoding other than identity (the client
//     would decode bytes no one inspected), a header whose name or value
//     names kv_transfer_params or a handle member;
//   - at the raw bytes of headers and body, and of the body decompressed
//     when it is a gzip or zlib stream: any of secrets (the distinctive values of the handles
//     in play, such as HostileSecrets) is a leak;
//   - at every JSON value the client would decode: the body, and the data
//     of every event of a stream, read both as the SSE specification says
//     and as lenient clients do (a byte order mark stripped from every
//     line, as go-sse does); every member at every depth is decoded
//     (escapes resolved, duplicates included, numbers as written), and a
//     member named kv_transfer_params or a handle member (HandleMembers), or
//     a decoded string holding a secret, is a leak. Data that is not JSON,
//     and a stream's line outside the data, that names a handle member or
//     holds a \u escape is a leak as well.
//
// A stream is recognised by its Content-Type (text/event-stream).
func CheckLeak(h http.Header, body []byte, secrets ...string) error {
	for k, vs := range h {
		name := strings.ReplaceAll(strings.ToLower(k), "-", "_")
		if name == "content_encoding" {
			for _, v := range vs {
				if !strings.EqualFold(strings.TrimSpace(v), "identity") {
					return fmt.Errorf("a Content-Encoding %q reached the client", v)
				}
			}
		}
		for _, m := range HandleMembers {
			if strings.Contains(name, m) || strings.Contains(name, strings.ReplaceAll(m, "_", "")) {
				return fmt.Errorf("a header %q names a handle member", k)
			}
		}
		for _, v := range vs {
			if err := checkText("header "+k, []byte(v), secrets); err != nil {
				return err
			}
		}
	}
	if err := checkRaw("the body", body, secrets); err != nil {
		return err
	}
	if plain := inflate(body); plain != nil {
		if err := checkRaw("the decompressed body", plain, secrets); err != nil {
			return err
		}
	}
	if mt, _, _ := strings.Cut(h.Get("Content-Type"), ";"); strings.EqualFold(strings.TrimSpace(mt), "text/event-stream") {
		for _, line := range bytes.FieldsFunc(body, func(r rune) bool { return r == '\r' || r == '\n' }) {
			line = bytes.TrimPrefix(line, []byte("\xef\xbb\xbf"))
			if !bytes.HasPrefix(line, []byte("data:")) && string(line) != "data" {
				if err := checkText("a line outside the data", line, secrets); err != nil {
					return err
				}
				if bytes.Contains(line, []byte(`\u`)) {
					return fmt.Errorf("a line outside the data holds a \\u escape: %.200q", line)
				}
			}
		}
		for _, lenient := range []bool{false, true} {
			for i, ev := range ParseEvents(body, lenient) {
				if err := checkData(fmt.Sprintf("event %d (lenient %v)", i, lenient), ev.Data, secrets); err != nil {
					return err
				}
			}
		}
		return nil
	}
	return checkData("the body", body, secrets)
}

// inflate returns b decompressed when it is a gzip or zlib stream (the
// frames brotli and zstd answers use here hold their bytes as they are, so
// the raw checks see them), else nil.
func inflate(b []byte) []byte {
	var r io.Reader
	switch {
	case bytes.HasPrefix(b, []byte{0x1f, 0x8b}):
		zr, err := gzip.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil
		}
		r = zr
	case len(b) > 2 && b[0] == 0x78 && (uint16(b[0])<<8|uint16(b[1]))%31 == 0:
		zr, err := zlib.NewReader(bytes.NewReader(b))
		if err != nil {
			return nil
		}
		r = zr
	default:
		return nil
	}
	plain, _ := io.ReadAll(io.LimitReader(r, 64<<20))
	return plain
}

// checkText looks for handle member names and secrets in text that is
// not JSON.
func checkText(where string, b []byte, secrets []string) error {
	for _, m := range HandleMembers {
		if bytes.Contains(b, []byte(m)) {
			return fmt.Errorf("%s names %s: %.200q", where, m, b)
		}
	}
	return checkRaw(where, b, secrets)
}

func checkRaw(where string, b []byte, secrets []string) error {
	for _, s := range secrets {
		if s != "" && bytes.Contains(b, []byte(s)) {
			return fmt.Errorf("%s holds the handle's %q", where, s)
		}
	}
	return nil
}

// checkData checks one event's data: JSON at every depth, or text.
func checkData(where string, d []byte, secrets []string) error {
	switch {
	case len(d) == 0 || string(d) == "[DONE]":
		return nil
	case json.Valid(d):
		return checkJSON(where, d, secrets)
	case bytes.Contains(d, []byte(`\u`)):
		return fmt.Errorf("%s is not JSON and holds a \\u escape: %.200q", where, d)
	}
	return checkText(where, d, secrets)
}

// checkJSON decodes every token of the JSON text b.
func checkJSON(where string, b []byte, secrets []string) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	type frame struct{ object, wantKey bool }
	var stack []frame
	valueDone := func() {
		if n := len(stack); n > 0 && stack[n-1].object {
			stack[n-1].wantKey = true
		}
	}
	for {
		tok, err := dec.Token()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: encoding/json: %v", where, err)
		}
		if d, ok := tok.(json.Delim); ok {
			switch d {
			case '{', '[':
				stack = append(stack, frame{object: d == '{', wantKey: d == '{'})
			default:
				stack = stack[:len(stack)-1]
				valueDone()
			}
			continue
		}
		s, isString := tok.(string)
		if n := len(stack); n > 0 && stack[n-1].wantKey {
			stack[n-1].wantKey = false
			if slices.Contains(HandleMembers, s) {
				return fmt.Errorf("%s has a member named %s", where, s)
			}
		} else {
			valueDone()
		}
		if isString {
			if err := checkRaw(where+" (a decoded string)", []byte(s), secrets); err != nil {
				return err
			}
		}
	}
}

// Event is one event of a stream as ParseEvents reads it.
type Event struct {
	Name, ID string
	Data     []byte
}

// ParseEvents splits an SSE stream into the events a client dispatches,
// as the WHATWG specification says (lines end in CR, LF or CRLF; a byte
// order mark is ignored at the start of the stream only; data lines join
// with LF; an event is dispatched at a blank line when it has data; an
// unterminated last event is not dispatched), or, with lenient, as
// clients that strip a byte order mark from the start of every line do.
// It is independent of package sse, so tests can check sse with it.
func ParseEvents(b []byte, lenient bool) []Event {
	const bom = "\xef\xbb\xbf"
	b = bytes.TrimPrefix(b, []byte(bom))
	var out []Event
	var data [][]byte
	var name, id string
	hasData := false
	for len(b) > 0 {
		i := bytes.IndexAny(b, "\r\n")
		if i < 0 {
			break // an unterminated last line: the event is not dispatched
		}
		line := b[:i]
		next := i + 1
		if b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n' {
			next = i + 2
		}
		b = b[next:]
		if lenient {
			line = bytes.TrimPrefix(line, []byte(bom))
		}
		if len(line) == 0 {
			if hasData {
				out = append(out, Event{Name: name, ID: id, Data: bytes.Join(data, []byte("\n"))})
			}
			data, name, hasData = nil, "", false
			continue
		}
		if line[0] == ':' {
			continue
		}
		field, value, _ := bytes.Cut(line, []byte(":"))
		value = bytes.TrimPrefix(value, []byte(" "))
		switch string(field) {
		case "data":
			data = append(data, value)
			hasData = true
		case "event":
			name = string(value)
		case "id":
			if bytes.IndexByte(value, 0) < 0 {
				id = string(value)
			}
		}
	}
	return out
}
