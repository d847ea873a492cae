package sse_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"io"
	"slices"
	"strings"
	"testing"

	gosse "github.com/tmaxmax/go-sse"

	"github.com/bidikv/bidikv/sse"
)

// splitReader returns input in reads of the given sizes (cycled).
type splitReader struct {
	data  []byte
	sizes []byte
	i     int
}

func (s *splitReader) Read(p []byte) (int, error) {
	if len(s.data) == 0 {
		return 0, io.EOF
	}
	n := len(p)
	if len(s.sizes) > 0 {
		n = int(s.sizes[s.i%len(s.sizes)])%64 + 1
		s.i++
	}
	n = copy(p[:min(n, len(p))], s.data)
	s.data = s.data[n:]
	return n, nil
}

type refEvent struct{ data, typ, id string }

// FuzzReader checks that the Reader never panics, that the Raw bytes of its
// events reproduce the input exactly, whatever the read boundaries, and
// that it agrees with go-sse's parser on data, event type and last event ID
// of every complete event with data.
func FuzzReader(f *testing.F) {
	for _, s := range []string{
		"data: a\n\n", "data: a\r\n\r\ndata: b\r\r", ": ping\n\nevent: x\nid: 1\ndata: y\ndata: z\n\n",
		"\xef\xbb\xbfdata: bom\n\n", "data: incomplete", "id\ndata\n\n\n\n", "retry: 10\ndata:x\r\n\n",
	} {
		f.Add([]byte(s), []byte{0})
		f.Add([]byte(s), []byte{1, 2, 3})
	}
	f.Fuzz(func(t *testing.T, in, sizes []byte) {
		r := sse.NewReader(&splitReader{data: in, sizes: sizes}, sse.WithMaxEventSize(1<<20))
		var raw bytes.Buffer
		var ours []refEvent
		lastID := ""
		for range len(in) + 2 {
			e, err := r.Next()
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				t.Fatalf("Next: %v", err)
			}
			if len(e.Raw) == 0 {
				t.Fatal("empty Raw")
			}
			raw.Write(e.Raw)
			if e.HasID {
				lastID = e.ID
			}
			if e.HasData && len(e.Data) > 0 && !e.Incomplete {
				ours = append(ours, refEvent{string(e.Data), e.Name, lastID})
			}
		}
		if !bytes.Equal(raw.Bytes(), in) {
			t.Fatalf("Raw concatenation %q != input %q", raw.Bytes(), in)
		}

		// go-sse strips a byte order mark at the start of any line; the SSE
		// specification (and Reader) only at the start of the stream, where
		// elsewhere it is part of a field name. Compare only inputs where
		// the two agree by construction.
		if i := bytes.Index(in, []byte(byteOrderMark)); i > 0 || (i == 0 && bytes.Contains(in[len(byteOrderMark):], []byte(byteOrderMark))) {
			return
		}
		var ref []refEvent
		for e, err := range gosse.Read(bytes.NewReader(in), &gosse.ReadConfig{MaxEventSize: 1 << 21}) {
			if err != nil {
				t.Skipf("go-sse: %v", err)
			}
			if e.Data != "" {
				ref = append(ref, refEvent{e.Data, e.Type, e.LastEventID})
			}
		}
		if len(ours) != len(ref) {
			t.Fatalf("%d events, go-sse %d:\nours %q\nref  %q", len(ours), len(ref), ours, ref)
		}
		for i := range ours {
			if ours[i] != ref[i] {
				t.Fatalf("event %d: ours %q, go-sse %q", i, ours[i], ref[i])
			}
		}
	})
}

func TestReaderAgreesWithGoSSE(t *testing.T) {
	// A fixed stream through the reference, as a readable smoke test of the
	// differential fuzz test above.
	in := "event: a\nid: 1\ndata: x\ndata: y\n\n: c\n\nid: 2\n\ndata: z\r\n\r\n"
	var ref []refEvent
	for e, err := range gosse.Read(strings.NewReader(in), nil) {
		if err != nil {
			t.Fatal(err)
		}
		ref = append(ref, refEvent{e.Data, e.Type, e.LastEventID})
	}
	want := []refEvent{{"x\ny", "a", "1"}, {"", "", "2"}, {"z", "", "2"}}
	if len(ref) != len(want) {
		t.Fatalf("go-sse gave %q", ref)
	}
	r := sse.NewReader(strings.NewReader(in))
	var got []refEvent
	lastID := ""
	for {
		e, err := r.Next()
		if err != nil {
			break
		}
		if e.HasID {
			lastID = e.ID
		}
		if !e.Comment {
			got = append(got, refEvent{string(e.Data), e.Name, lastID})
		}
	}
	if len(got) != len(want) {
		t.Fatalf("got %q", got)
	}
	for i := range want {
		if got[i] != want[i] || ref[i] != want[i] {
			t.Errorf("event %d: ours %q, go-sse %q, want %q", i, got[i], ref[i], want[i])
		}
	}
}

// FuzzCapture checks that Forward never panics, that every event it
// forwards is complete, and that a client reading what it forwarded, as
// the SSE specification says or as lenient clients do (a byte order mark
// stripped from every line), decodes in no event's data, at any depth and
// whatever the escapes, a member named kv_transfer_params or a member only
// handles have. Like the router, it stops at the first event that fails.
// endsWithBlankLine reports whether b's last line is blank.
// checkForwarded is FuzzCapture's oracle.
// clientData returns the data of every event a client dispatches from b:
// lines end in CR, LF or CRLF, the stream's byte order mark is ignored
// (with lenient, one at the start of any line), unterminated last events
// are dropped.
// handleMembers are the names FuzzCapture's oracle looks for: the handle's
// key and the members only handles have.
var handleMembers = []string{sse.HandleKey, "do_remote_decode", "do_remote_prefill", "remote_block_ids",
	"remote_engine_id", "remote_request_id", "remote_num_tokens", "remote_blocks_expiry_time"}

// handleMember decodes the JSON text d token by token and returns the
// first member name, at any depth, that is one of handleMembers.
func handleMember(d []byte) (string, bool) {
	dec := json.NewDecoder(bytes.NewReader(d))
	dec.UseNumber()
	type frame struct{ object, wantKey bool }
	var stack []frame
	done := func() {
		if n := len(stack); n > 0 && stack[n-1].object {
			stack[n-1].wantKey = true
		}
	}
	for {
		tok, err := dec.Token()
		if err != nil {
			return "", false
		}
		if dl, ok := tok.(json.Delim); ok {
			if dl == '{' || dl == '[' {
				stack = append(stack, frame{object: dl == '{', wantKey: dl == '{'})
			} else {
				stack = stack[:len(stack)-1]
				done()
			}
			continue
		}
		if n := len(stack); n > 0 && stack[n-1].wantKey {
			stack[n-1].wantKey = false
			if s := tok.(string); slices.Contains(handleMembers, s) {
				return s, true
			}
			continue
		}
		done()
	}
}

// FuzzScrub checks Scrub against encoding/json: it accepts only valid
// JSON, what it returns decodes with no handle member at any depth, and it
// refuses valid JSON only for a member only handles have outside every
// kv_transfer_params member.
func FuzzScrub(f *testing.F) {
	for _, s := range []string{
		`{"kv_transfer_params":{"remote_engine_id":"d"}}`, `{"a":[{"\u006bv_transfer_params":1},{"remote_host":"h"}]}`,
		`{"usage":{"remote_block_ids":[[1]]}}`, `[1,{"kv_transfer_params":null,"kv_transfer_params":2}]`, `"x"`, `{"a":1e999}`,
		"{\"\xff\":{\"kv_transfer_params\":1}}", `{"kv\u005Ftransfer_params":1,"do_remote_decode":true}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		out, changed, err := sse.Scrub(nil, in)
		valid := json.Valid(in)
		if err != nil {
			if !errors.Is(err, sse.ErrMalformedData) {
				t.Fatalf("unexpected error %v", err)
			}
			if valid {
				// Only a member only handles have, outside kv_transfer_params.
				if _, ok := handleMember(in); !ok {
					t.Fatalf("Scrub refuses %q, which has no handle member", in)
				}
			}
			return
		}
		if !valid {
			t.Fatalf("Scrub accepts invalid %q", in)
		}
		if !changed && !bytes.Equal(in, out) {
			t.Fatalf("unchanged but different: %q -> %q", in, out)
		}
		if name, ok := handleMember(out); ok {
			t.Fatalf("Scrub(%q) = %q still has %q", in, out, name)
		}
	})
}

// byteOrderMark is the UTF-8 BOM.
const byteOrderMark = "\xef\xbb\xbf"
