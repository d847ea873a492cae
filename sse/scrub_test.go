package sse_test

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/sse"
)

func TestScrub(t *testing.T) {
	const h = `{"remote_engine_id":"d","remote_block_ids":[[1]]}`
	for in, want := range map[string]string{
		`{"a":1}`:                          `{"a":1}`,
		`{"kv_transfer_params":` + h + `}`: `{}`,
		`{"a":{"b":[{"\u006bv_transfer_params":` + h + `,"c":1}]},"d":"kv_transfer_params"}`: `{"a":{"b":[{"c":1}]},"d":"kv_transfer_params"}`,
		`{"usage":{"x":1,"kv\u005Ftransfer_params":null}}`:                                   `{"usage":{"x":1}}`,
		`[{"kv_transfer_params":1},{"kv_transfer_params":2}]`:                                `[{},{}]`,
		`{"n":1e999,"m":-123456789012345678901234567890,"kv_transfer_params":1}`:             `{"n":1e999,"m":-123456789012345678901234567890}`,
		"{\"s\":\"\xff\\u0041\",\"kv_transfer_params\xfe\":1}":                               "{\"s\":\"\xff\\u0041\",\"kv_transfer_params\xfe\":1}",
		`{"remote_host":"h","remote_port":1,"tp_size":1}`:                                    `{"remote_host":"h","remote_port":1,"tp_size":1}`,
		`"kv_transfer_params"`: `"kv_transfer_params"`,
	} {
		out, changed, err := sse.Scrub(nil, []byte(in))
		require.NoError(t, err, in)
		assert.Equal(t, want, string(out), in)
		assert.Equal(t, want != in, changed, in)
	}
	for _, in := range []string{
		`{"usage":{"remote_engine_id":"d"}}`,
		`{"a":[{"\u0072emote_block_ids":[[1]]}]}`,
		`{"do_remote_prefill":true}`,
		`{"kv_transfer_params":1`,
		"\xef\xbb\xbf{}",
		"\x1f\x8b\x08\x00",
		`{"a":1} {"b":2}`,
		``,
		`not json`,
	} {
		_, _, err := sse.Scrub(nil, []byte(in))
		assert.ErrorIs(t, err, sse.ErrMalformedData, "%q", in)
	}
}

// forwardEach runs every event of in through ScrubEvent and returns what
// it forwarded, stopping at the first error.
func forwardEach(t *testing.T, in string) (string, error) {
	t.Helper()
	r := sse.NewReader(strings.NewReader(in))
	var out bytes.Buffer
	for {
		e, err := r.Next()
		if err == io.EOF {
			return out.String(), nil
		}
		require.NoError(t, err)
		b, _, err := sse.ScrubEvent(nil, e, e.Data, false)
		if err != nil {
			return out.String(), err
		}
		out.Write(b)
	}
}

// Issue 21.5: a byte order mark before a line in the middle of a stream is
// part of a field name for the reader (as the specification says), and
// ScrubEvent classifies the line the same way: a field no client should
// read, dropped. Only the stream's first byte order mark is ignored.
func TestScrubEventByteOrderMarks(t *testing.T) {
	const bom = "\xef\xbb\xbf"
	first := `data: {"choices":[]}` + "\n\n"
	handle := `{"kv_transfer_params":{"remote_engine_id":"d"}}`
	for _, in := range []string{
		first + bom + "data: " + handle + "\n\n",
		first + `data: {"a":1` + "\n" + bom + "data: " + handle + "\ndata: }\n\n",
		first + bom + ": " + handle + "\n" + bom + "event: x\ndata: {}\n\n",
	} {
		out, err := forwardEach(t, in)
		require.NoError(t, err, "%q", in)
		assert.NotContains(t, out, "remote_", "%q", in)
		assert.NotContains(t, out, bom, "%q", in)
	}
	out, err := forwardEach(t, bom+"data: "+handle+"\n\n")
	require.NoError(t, err)
	assert.Equal(t, bom+"data: {}\n\n", out, "the stream's own byte order mark is kept, its event scrubbed")
}

// Issue 21.6: an event split over several data lines is judged on its
// joined data: split inside a name it is not JSON and fails; split between
// members it is scrubbed.
func TestScrubEventSplitData(t *testing.T) {
	final := `{"type":"response.completed","response":{"id":"r","kv_transfer_params":{"remote_engine_id":"d","remote_host":"10.9.8.7"}}}`
	at := strings.Index(final, "kv_transfer_params")
	for _, cut := range []int{at + 1, at + 11, strings.Index(final, "remote_engine_id") + 4, strings.Index(final, "10.9") + 2} {
		in := "event: response.completed\ndata: " + final[:cut] + "\ndata: " + final[cut:] + "\n\n"
		out, err := forwardEach(t, in)
		assert.ErrorIs(t, err, sse.ErrMalformedData, "split at %d", cut)
		assert.Empty(t, out)
	}
	in := "event: response.completed\ndata: " + final[:at-1] + "\ndata: " + final[at-1:] + "\n\n"
	out, err := forwardEach(t, in)
	require.NoError(t, err)
	assert.Equal(t, "event: response.completed\ndata: "+`{"type":"response.completed","response":{"id":"r"}}`+"\n\n", out)
}

// Issue 21.20: an event the stream ended inside is not forwarded (a client
// would not dispatch it either).
func TestScrubEventIncomplete(t *testing.T) {
	out, err := forwardEach(t, `data: {"a":1}`+"\n\n"+`data: {"choices":[{"delta":{"con`)
	require.NoError(t, err)
	assert.Equal(t, `data: {"a":1}`+"\n\n", out)
	out, err = forwardEach(t, `data: {"a":1}`+"\n\n"+`data: {"kv_transfer_params":{"remote_engine_id":"d"}}`+"\n")
	require.NoError(t, err)
	assert.Equal(t, `data: {"a":1}`+"\n\n", out)
}

// Lines outside the data: only comments and the fields a client reads,
// as text naming no handle and holding no backslash, are forwarded.
func TestScrubEventOtherLines(t *testing.T) {
	kept := ": ping\nevent: message_start\nid: 7\nretry: 10\n"
	for _, drop := range []string{
		": kv_transfer_params\n", ": remote_engine_id\n", ": \\u006bv_transfer_params\n", ": \xff\xfe\n", ": a\x01b\n",
		"kv_transfer_params: 1\n", "unknown: field\n", "datum: x\n", "id: remote_engine_id\n", "event: kv_transfer_params\n",
	} {
		in := kept + drop + "data: {}\n\n"
		e, err := sse.NewReader(strings.NewReader(in)).Next()
		require.NoError(t, err)
		out, rewritten, err := sse.ScrubEvent(nil, e, e.Data, false)
		require.NoError(t, err)
		assert.True(t, rewritten)
		assert.Equal(t, kept+"data: {}\n\n", string(out), "%q", drop)
	}
	e, err := sse.NewReader(strings.NewReader(kept + "data: {}\n\n")).Next()
	require.NoError(t, err)
	out, rewritten, err := sse.ScrubEvent(nil, e, e.Data, false)
	require.NoError(t, err)
	assert.False(t, rewritten)
	assert.Same(t, &e.Raw[0], &out[0])
}

// A dropped line between a line that ends in a lone "\r" and a line that
// starts with "\n" must not join the two into one CRLF: the blank line
// that ends the event would vanish and the next event would run into this
// one (found by FuzzCapture).
func TestScrubEventDroppedLineKeepsEventEnd(t *testing.T) {
	for _, in := range []string{
		"event:\rdropped\n\n", "event: x\runknown: y\n\n", "data: {}\r: kv_transfer_params\n\n",
		"id: 1\rnot-a-field\n\ndata: {}\n\n", "event: a\rx\ny\r\n\r\n",
	} {
		r := sse.NewReader(strings.NewReader(in))
		e, err := r.Next()
		require.NoError(t, err, "%q", in)
		out, _, err := sse.ScrubEvent(nil, e, e.Data, false)
		require.NoError(t, err, "%q", in)
		// A client reads the forwarded bytes as exactly one event.
		fr := sse.NewReader(bytes.NewReader(append(bytes.Clone(out), "data: {}\n\n"...)))
		first, err := fr.Next()
		require.NoError(t, err, "%q -> %q", in, out)
		assert.False(t, first.Incomplete, "%q -> %q", in, out)
		assert.Equal(t, e.Name, first.Name, "%q -> %q", in, out)
		assert.Equal(t, string(e.Data), string(first.Data), "%q -> %q", in, out)
		second, err := fr.Next()
		require.NoError(t, err, "%q -> %q: the next event ran into this one", in, out)
		assert.Equal(t, "{}", string(second.Data), "%q -> %q", in, out)
	}
}

// Data that is neither JSON nor [DONE] (or empty) is never forwarded.
func TestScrubEventNotJSON(t *testing.T) {
	for _, data := range []string{"not json", "kv_transfer_params=1", "{\"a\":1", "\x1f\x8b\x08", `{"a":1}}`} {
		_, err := forwardEach(t, "data: "+data+"\n\n")
		assert.ErrorIs(t, err, sse.ErrMalformedData, "%q", data)
	}
	for _, data := range []string{"[DONE]", "", "1", `"text"`, "null"} {
		out, err := forwardEach(t, "data: "+data+"\n\n")
		require.NoError(t, err, "%q", data)
		assert.Equal(t, "data: "+data+"\n\n", out)
	}
}
