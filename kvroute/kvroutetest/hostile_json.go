package kvroutetest

import (
	"bytes"
	"compress/gzip"
	"compress/zlib"
	"encoding/binary"
	"strconv"
	"strings"
)

// A small ordered JSON tree, to write answers with a member inserted at
// any position and a key spelled any way.
type (
	jnode   any // jobj, jarr or jraw
	jobj    []jmember
	jarr    []jnode
	jraw    string // JSON text, written as is
	jmember struct {
		key string // the key as written between its quotes (escapes kept)
		val jnode
	}
)

func jstr(s string) jraw { return jraw(strconv.Quote(s)) }

// enc writes n compactly.
func enc(n jnode) string {
	var b strings.Builder
	encTo(&b, n)
	return b.String()
}

func encTo(b *strings.Builder, n jnode) {
	switch v := n.(type) {
	case jobj:
		b.WriteByte('{')
		for i, m := range v {
			if i > 0 {
				b.WriteByte(',')
			}
			b.WriteByte('"')
			b.WriteString(m.key)
			b.WriteString(`":`)
			encTo(b, m.val)
		}
		b.WriteByte('}')
	case jarr:
		b.WriteByte('[')
		for i, e := range v {
			if i > 0 {
				b.WriteByte(',')
			}
			encTo(b, e)
		}
		b.WriteByte(']')
	case jraw:
		b.WriteString(string(v))
	}
}

// objectPaths returns the path of every object in n, in pre-order ("" for
// n itself): the positions hostile answers put a member at.
func objectPaths(n jnode, path string, out []string) []string {
	switch v := n.(type) {
	case jobj:
		out = append(out, path)
		for _, m := range v {
			p := m.key
			if path != "" {
				p = path + "." + m.key
			}
			out = objectPaths(m.val, p, out)
		}
	case jarr:
		for i, e := range v {
			out = objectPaths(e, path+"["+strconv.Itoa(i)+"]", out)
		}
	}
	return out
}

// insertAt returns a copy of n with ms inserted at the start (first) or
// end of the target-th object in pre-order; *seen counts the objects
// passed.
func insertAt(n jnode, target int, seen *int, first bool, ms ...jmember) jnode {
	switch v := n.(type) {
	case jobj:
		here := *seen == target
		*seen++
		out := make(jobj, 0, len(v)+len(ms))
		if here && first {
			out = append(out, ms...)
		}
		for _, m := range v {
			out = append(out, jmember{m.key, insertAt(m.val, target, seen, first, ms...)})
		}
		if here && !first {
			out = append(out, ms...)
		}
		return out
	case jarr:
		out := make(jarr, len(v))
		for i, e := range v {
			out[i] = insertAt(e, target, seen, first, ms...)
		}
		return out
	}
	return n
}

// with returns n with ms at the start of its target-th object.
func with(n jnode, target int, ms ...jmember) jnode {
	seen := 0
	return insertAt(n, target, &seen, true, ms...)
}

// withLast returns n with ms at the end of its target-th object.
func withLast(n jnode, target int, ms ...jmember) jnode {
	seen := 0
	return insertAt(n, target, &seen, false, ms...)
}

// handleMembers returns the members of the handle h (a JSON object), for
// answers that spread them where the wrapper would be.
func handleMembers(h string) []jmember {
	var out []jmember
	// h is one of this file's handles: flat, no nested objects, and no
	// commas inside values other than the block id lists.
	s := strings.TrimSuffix(strings.TrimPrefix(h, "{"), "}")
	for s != "" {
		colon := strings.Index(s, `":`)
		key := s[1:colon]
		s = s[colon+2:]
		end, depth := 0, 0
		for end < len(s) {
			switch s[end] {
			case '[':
				depth++
			case ']':
				depth--
			}
			if s[end] == ',' && depth == 0 {
				break
			}
			end++
		}
		out = append(out, jmember{key, jraw(s[:end])})
		s = strings.TrimPrefix(s[end:], ",")
	}
	return out
}

// The key spellings hostile answers use for kv_transfer_params: each
// decodes to it.
var keySpellings = []struct{ name, key string }{
	{"literal", "kv_transfer_params"},
	{`\u006b`, `\u006bv_transfer_params`},
	{`\u005f`, `kv\u005ftransfer_params`},
	{"all escaped", `\u006B\u0076\u005F\u0074\u0072\u0061\u006E\u0073\u0066\u0065\u0072\u005F\u0070\u0061\u0072\u0061\u006D\u0073`},
}

const kvKey = "kv_transfer_params"

// gzipped, zlibbed, zstdStored and brotliStored compress b. The last two
// write frames that hold b uncompressed (a zstd frame of raw blocks, RFC
// 8878; a brotli stream of uncompressed meta-blocks, RFC 7932), which every
// decoder reads, without a compressor in this module.
func gzipped(b []byte) []byte {
	var out bytes.Buffer
	w := gzip.NewWriter(&out)
	_, _ = w.Write(b)
	_ = w.Close()
	return out.Bytes()
}

func zlibbed(b []byte) []byte {
	var out bytes.Buffer
	w := zlib.NewWriter(&out)
	_, _ = w.Write(b)
	_ = w.Close()
	return out.Bytes()
}

func zstdStored(b []byte) []byte {
	// Magic, a frame header with only a window descriptor (1 MiB), then
	// raw blocks of at most 128 KiB, the last one flagged.
	out := []byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x50}
	for first := true; first || len(b) > 0; first = false {
		n := min(len(b), 128<<10)
		hdr := uint32(n) << 3 // block type 0: raw
		if n == len(b) {
			hdr |= 1 // last block
		}
		out = append(out, byte(hdr), byte(hdr>>8), byte(hdr>>16))
		out = append(out, b[:n]...)
		b = b[n:]
	}
	return out
}

func brotliStored(b []byte) []byte {
	var out []byte
	for first := true; len(b) > 0; first = false {
		n := min(len(b), 1<<16)
		// ISLAST 0, MNIBBLES 4 (00), MLEN-1 in 16 bits, ISUNCOMPRESSED 1,
		// padded to a byte boundary; the stream's first header starts
		// with WBITS 16 (one 0 bit).
		var v uint32
		if first {
			v = uint32(n-1)<<4 | 1<<20
		} else {
			v = uint32(n-1)<<3 | 1<<19
		}
		var hdr [4]byte
		binary.LittleEndian.PutUint32(hdr[:], v)
		out = append(out, hdr[:3]...)
		out = append(out, b[:n]...)
		b = b[n:]
	}
	if out == nil {
		return []byte{0x06} // WBITS 16, ISLAST, ISLASTEMPTY: an empty stream
	}
	return append(out, 0x03) // ISLAST, ISLASTEMPTY
}
