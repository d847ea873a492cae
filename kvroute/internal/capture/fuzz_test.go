package capture_test

import (
	"bytes"
	"encoding/json"
	"errors"

	"slices"

	"testing"

	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/sse"
)

func FuzzCapture(f *testing.F) {
	f.Add([]byte("data: {\"kv_transfer_params\":{\"a\":1},\"b\":2}\n\n"))
	f.Add([]byte("data: {\"kv\\u005ftransfer_params\":1}\r\rdata: [DONE]\r\r"))
	f.Add([]byte("event: x\ndata: {\"a\":\ndata: 1, \"kv_transfer_params\": null}\n: c\n\n"))
	f.Add([]byte("data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"i\",\"function\":{\"name\":\"n\",\"arguments\":\"{\"}}]}}]}\n\n"))
	f.Add([]byte("data: {\"choices\":[{\"delta\":{\"\\u006bv_transfer_params\":{\"remote_engine_id\":\"d\"}}}],\"usage\":{\"kv_transfer_params\":1}}\n\n"))
	f.Add([]byte("data: {}\n\n\xef\xbb\xbfdata: {\"kv_transfer_params\":1}\n\n"))
	f.Add([]byte("event: response.completed\ndata: {\"response\":{\"kv_transfer_\ndata: params\":{\"remote_engine_id\":\"d\"}}}\n\n"))
	f.Add([]byte("data: {\"usage\":{\"remote_block_ids\":[[1]]}}\n\ndata: [{\"kv_transfer_params\":1e999}]\n\n"))
	f.Fuzz(func(t *testing.T, in []byte) {
		r := sse.NewReader(bytes.NewReader(in))
		c := capture.NewChunks(capture.WithReply())
		var out bytes.Buffer
		for range len(in) + 2 {
			e, err := r.Next()
			if err != nil {
				break
			}
			b, err := c.Forward(e)
			if err != nil {
				if !errors.Is(err, sse.ErrMalformedData) {
					t.Fatalf("unexpected error %v", err)
				}
				break
			}
			if e.Incomplete && len(b) > 0 {
				t.Fatalf("an incomplete event was forwarded: %q", b)
			}
			out.Write(b)
			if rest := bytes.TrimPrefix(b, []byte(byteOrderMark)); len(rest) > 0 && !endsWithBlankLine(rest) {
				t.Fatalf("forwarded event does not end with a blank line: %q", b)
			}
		}
		_ = c.Reply()
		checkForwarded(t, out.Bytes())
	})
}

func endsWithBlankLine(b []byte) bool {
	switch {
	case bytes.HasSuffix(b, []byte("\r\n")):
		b = b[:len(b)-2]
	case bytes.HasSuffix(b, []byte("\n")), bytes.HasSuffix(b, []byte("\r")):
		b = b[:len(b)-1]
	default:
		return false
	}
	return len(b) == 0 || b[len(b)-1] == '\n' || b[len(b)-1] == '\r'
}

func checkForwarded(t *testing.T, out []byte) {
	t.Helper()
	for _, lenient := range []bool{false, true} {
		for _, d := range clientData(out, lenient) {
			if !json.Valid(d) {
				continue // a client cannot decode it (the capture forwards none with a name or escape)
			}
			if name, ok := handleMember(d); ok {
				t.Fatalf("a client decodes a member %q (lenient %v) from %q", name, lenient, out)
			}
		}
	}
}

func clientData(b []byte, lenient bool) [][]byte {
	b = bytes.TrimPrefix(b, []byte(byteOrderMark))
	var out, data [][]byte
	has := false
	for len(b) > 0 {
		i := bytes.IndexAny(b, "\r\n")
		if i < 0 {
			break
		}
		line := b[:i]
		next := i + 1
		if b[i] == '\r' && i+1 < len(b) && b[i+1] == '\n' {
			next = i + 2
		}
		b = b[next:]
		if lenient {
			line = bytes.TrimPrefix(line, []byte(byteOrderMark))
		}
		switch {
		case len(line) == 0:
			if has {
				out = append(out, bytes.Join(data, []byte("\n")))
			}
			data, has = nil, false
		case bytes.Equal(line, []byte("data")):
			data, has = append(data, nil), true
		case bytes.HasPrefix(line, []byte("data:")):
			data, has = append(data, bytes.TrimPrefix(line[5:], []byte(" "))), true
		}
	}
	return out
}

var handleMembers = []string{sse.HandleKey, "do_remote_decode", "do_remote_prefill", "remote_block_ids",
	"remote_engine_id", "remote_request_id", "remote_num_tokens", "remote_blocks_expiry_time"}

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

const byteOrderMark = "\xef\xbb\xbf"
