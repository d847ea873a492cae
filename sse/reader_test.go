package sse_test

import (
	"bytes"
	"errors"
	"io"
	"strings"
	"testing"
	"testing/iotest"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/sse"
)

// ev is a comparable copy of an Event.
type ev struct {
	Raw, Data  string
	Name, ID   string
	Retry      time.Duration
	HasData    bool
	HasID      bool
	HasRetry   bool
	Comment    bool
	Incomplete bool
}

func copyEvent(e sse.Event) ev {
	return ev{
		Raw: string(e.Raw), Data: string(e.Data), Name: e.Name, ID: e.ID, Retry: e.Retry,
		HasData: e.HasData, HasID: e.HasID, HasRetry: e.HasRetry, Comment: e.Comment, Incomplete: e.Incomplete,
	}
}

// readAll returns every event of r until an error, and the error.
func readAll(r *sse.Reader) ([]ev, error) {
	var out []ev
	for range 100000 {
		e, err := r.Next()
		if err != nil {
			return out, err
		}
		out = append(out, copyEvent(e))
	}
	return out, errors.New("too many events")
}

// readers wraps an input in the testing/iotest readers.
var readers = []struct {
	name string
	wrap func(io.Reader) io.Reader
}{
	{"plain", func(r io.Reader) io.Reader { return r }},
	{"one byte", iotest.OneByteReader},
	{"half", iotest.HalfReader},
	{"data+EOF", iotest.DataErrReader},
}

func TestReader(t *testing.T) {
	data := func(raw, data string) ev { return ev{Raw: raw, Data: data, HasData: true} }
	tests := []struct {
		name string
		in   string
		want []ev
	}{
		{"empty", "", nil},
		{"one event", "data: hello\n\n", []ev{data("data: hello\n\n", "hello")}},
		{"no space after colon", "data:hello\n\n", []ev{data("data:hello\n\n", "hello")}},
		{"only one space stripped", "data:  two\n\n", []ev{data("data:  two\n\n", " two")}},
		{"CRLF", "data: a\r\n\r\ndata: b\r\n\r\n", []ev{data("data: a\r\n\r\n", "a"), data("data: b\r\n\r\n", "b")}},
		{"CR", "data: a\r\rdata: b\r\r", []ev{data("data: a\r\r", "a"), data("data: b\r\r", "b")}},
		{"mixed endings", "data: a\r\ndata: b\rdata: c\n\r\n", []ev{data("data: a\r\ndata: b\rdata: c\n\r\n", "a\nb\nc")}},
		{"multi-line data", "data: {\"a\":\ndata: 1}\n\n", []ev{data("data: {\"a\":\ndata: 1}\n\n", "{\"a\":\n1}")}},
		{"empty data line", "data\n\n", []ev{data("data\n\n", "")}},
		{"empty data lines join", "data:\ndata:\n\n", []ev{data("data:\ndata:\n\n", "\n")}},
		{"event id retry", "event: add\nid: 7\nretry: 1500\ndata: x\n\n", []ev{{
			Raw: "event: add\nid: 7\nretry: 1500\ndata: x\n\n", Data: "x", Name: "add", ID: "7",
			Retry: 1500 * time.Millisecond, HasData: true, HasID: true, HasRetry: true,
		}}},
		{"bad retry ignored", "retry: 1a\ndata: x\n\n", []ev{data("retry: 1a\ndata: x\n\n", "x")}},
		{"id with NUL ignored", "id: a\x00b\ndata: x\n\n", []ev{data("id: a\x00b\ndata: x\n\n", "x")}},
		{"empty id", "id\ndata: x\n\n", []ev{{Raw: "id\ndata: x\n\n", Data: "x", HasData: true, HasID: true}}},
		{"last field wins", "event: a\nevent: b\nid: 1\nid: 2\ndata: x\n\n", []ev{{
			Raw: "event: a\nevent: b\nid: 1\nid: 2\ndata: x\n\n", Data: "x", Name: "b", ID: "2", HasData: true, HasID: true,
		}}},
		{"keep-alive comment block", ": ping\n\ndata: x\n\n", []ev{{Raw: ": ping\n\n", Comment: true}, data("data: x\n\n", "x")}},
		{"comment inside event", "data: a\n: note\ndata: b\n\n", []ev{data("data: a\n: note\ndata: b\n\n", "a\nb")}},
		{"unknown field", "foo: bar\n\n", []ev{{Raw: "foo: bar\n\n"}}},
		{"event without data", "event: x\n\n", []ev{{Raw: "event: x\n\n", Name: "x"}}},
		{"extra blank lines lead the next event", "data: a\n\n\n\ndata: b\n\n", []ev{data("data: a\n\n", "a"), data("\n\ndata: b\n\n", "b")}},
		{"trailing blank lines", "data: a\n\n\n\n", []ev{data("data: a\n\n", "a"), {Raw: "\n\n", Comment: true}}},
		{"final event without blank line", "data: a\n\ndata: b\n", []ev{data("data: a\n\n", "a"), {Raw: "data: b\n", Data: "b", HasData: true, Incomplete: true}}},
		{"final line without terminator", "data: a", []ev{{Raw: "data: a", Data: "a", HasData: true, Incomplete: true}}},
		{"BOM", "\xef\xbb\xbfdata: a\n\n", []ev{data("\xef\xbb\xbfdata: a\n\n", "a")}},
		{"BOM only at start", "data: a\n\n\xef\xbb\xbfdata: b\n\n", []ev{data("data: a\n\n", "a"), {Raw: "\xef\xbb\xbfdata: b\n\n"}}},
		{"BOM after blank line is not stripped", "\n\xef\xbb\xbfdata: b\n\n", []ev{{Raw: "\n\xef\xbb\xbfdata: b\n\n"}}},
		{"colon in value", "data: a: b\n\n", []ev{data("data: a: b\n\n", "a: b")}},
		{"DONE", "data: {\"x\":1}\n\ndata: [DONE]\n\n", []ev{data("data: {\"x\":1}\n\n", `{"x":1}`), data("data: [DONE]\n\n", "[DONE]")}},
	}
	for _, tt := range tests {
		for _, rd := range readers {
			t.Run(tt.name+"/"+rd.name, func(t *testing.T) {
				got, err := readAll(sse.NewReader(rd.wrap(strings.NewReader(tt.in))))
				require.ErrorIs(t, err, io.EOF)
				assert.Equal(t, tt.want, normalizeCRLF(got))
				var raw strings.Builder
				for _, e := range got {
					raw.WriteString(e.Raw)
				}
				assert.Equal(t, tt.in, raw.String(), "Raw concatenation reproduces the input")
			})
		}
	}
}

// normalizeCRLF undoes the one framing difference that read boundaries may
// cause: a blank line ending in '\r' as the last byte read dispatches at
// once, so the '\n' of its "\r\n" leads the next block's Raw.
func normalizeCRLF(evs []ev) []ev {
	var out []ev
	for _, e := range evs {
		if n := len(out); n > 0 && strings.HasSuffix(out[n-1].Raw, "\r") && strings.HasPrefix(e.Raw, "\n") {
			out[n-1].Raw += "\n"
			e.Raw = e.Raw[1:]
			if e.Raw == "" {
				continue
			}
		}
		out = append(out, e)
	}
	return out
}

// chunkReader returns its chunks one Read at a time.
type chunkReader struct{ chunks []string }

func (c *chunkReader) Read(p []byte) (int, error) {
	if len(c.chunks) == 0 {
		return 0, io.EOF
	}
	n := copy(p, c.chunks[0])
	c.chunks[0] = c.chunks[0][n:]
	if c.chunks[0] == "" {
		c.chunks = c.chunks[1:]
	}
	return n, nil
}

func TestReaderSplitCRLF(t *testing.T) {
	tests := []struct {
		name   string
		chunks []string
		want   []string // Data of each event with data
	}{
		{"CR LF split inside event", []string{"data: a\r", "\ndata: b\r\n\r\n"}, []string{"a\nb"}},
		{"CR LF split on blank line", []string{"data: a\r\n\r", "\ndata: b\r\n\r\n"}, []string{"a", "b"}},
		{"CR then CR", []string{"data: a\r", "\rdata: b\r\r"}, []string{"a", "b"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := strings.Join(tt.chunks, "")
			got, err := readAll(sse.NewReader(&chunkReader{chunks: tt.chunks}))
			require.ErrorIs(t, err, io.EOF)
			var datas []string
			var raw strings.Builder
			for _, e := range got {
				raw.WriteString(e.Raw)
				if e.HasData {
					datas = append(datas, e.Data)
				}
			}
			assert.Equal(t, tt.want, datas)
			assert.Equal(t, in, raw.String())
		})
	}
}

func TestReaderDispatchesWithoutWaiting(t *testing.T) {
	// The event must be returned as soon as its blank line arrives, even
	// when that blank line is a lone '\r' at the end of what was read.
	pr, pw := io.Pipe()
	defer pr.Close()
	go func() {
		_, _ = pw.Write([]byte("data: a\r\r"))
	}()
	r := sse.NewReader(pr)
	e, err := r.Next()
	require.NoError(t, err)
	assert.Equal(t, "a", string(e.Data))
	_ = pw.Close()
	_, err = r.Next()
	assert.ErrorIs(t, err, io.EOF)
}

func TestReaderMaxEventSize(t *testing.T) {
	small := "data: " + strings.Repeat("x", 50) + "\n\n"
	big := "data: " + strings.Repeat("y", 200) + "\n\n"
	for _, rd := range readers {
		t.Run(rd.name, func(t *testing.T) {
			r := sse.NewReader(rd.wrap(strings.NewReader(small+big+small)), sse.WithMaxEventSize(100))
			e, err := r.Next()
			require.NoError(t, err)
			assert.Equal(t, small, string(e.Raw))
			_, err = r.Next()
			assert.ErrorIs(t, err, sse.ErrEventTooLarge)
			_, err = r.Next()
			assert.ErrorIs(t, err, sse.ErrEventTooLarge, "sticky")
		})
	}
	t.Run("exact size fits", func(t *testing.T) {
		r := sse.NewReader(strings.NewReader(small), sse.WithMaxEventSize(len(small)))
		_, err := r.Next()
		assert.NoError(t, err)
	})
	t.Run("huge unterminated line", func(t *testing.T) {
		r := sse.NewReader(io.MultiReader(strings.NewReader("data: "), &infinite{}), sse.WithMaxEventSize(1<<16))
		_, err := r.Next()
		assert.ErrorIs(t, err, sse.ErrEventTooLarge)
	})
	t.Run("default", func(t *testing.T) {
		line := "data: " + strings.Repeat("z", sse.DefaultMaxEventSize) + "\n\n"
		_, err := sse.NewReader(strings.NewReader(line), sse.WithMaxEventSize(0)).Next()
		assert.ErrorIs(t, err, sse.ErrEventTooLarge)
	})
}

// infinite yields 'x' forever.
type infinite struct{}

func (*infinite) Read(p []byte) (int, error) {
	for i := range p {
		p[i] = 'x'
	}
	return len(p), nil
}

func TestReaderErrors(t *testing.T) {
	boom := errors.New("boom")
	t.Run("error after complete event", func(t *testing.T) {
		in := io.MultiReader(strings.NewReader("data: a\n\ndata: b\n"), iotest.ErrReader(boom))
		r := sse.NewReader(in)
		e, err := r.Next()
		require.NoError(t, err)
		assert.Equal(t, "a", string(e.Data))
		_, err = r.Next()
		assert.ErrorIs(t, err, boom, "the interrupted block is lost")
		_, err = r.Next()
		assert.ErrorIs(t, err, boom, "sticky")
	})
	t.Run("timeout", func(t *testing.T) {
		r := sse.NewReader(iotest.TimeoutReader(strings.NewReader("data: a\n\ndata: b\n\n")))
		e, err := r.Next()
		require.NoError(t, err)
		assert.Equal(t, "a", string(e.Data))
		e, err = r.Next()
		require.NoError(t, err, "already buffered")
		assert.Equal(t, "b", string(e.Data))
		_, err = r.Next()
		assert.ErrorIs(t, err, iotest.ErrTimeout)
	})
	t.Run("data with error", func(t *testing.T) {
		r := sse.NewReader(&dataErr{data: "data: a\n\n", err: boom})
		e, err := r.Next()
		require.NoError(t, err)
		assert.Equal(t, "a", string(e.Data))
		_, err = r.Next()
		assert.ErrorIs(t, err, boom)
	})
	t.Run("no progress", func(t *testing.T) {
		_, err := sse.NewReader(emptyReader{}).Next()
		assert.ErrorIs(t, err, io.ErrNoProgress)
	})
}

// dataErr returns its data and err from the same Read.
type dataErr struct {
	data string
	err  error
}

func (d *dataErr) Read(p []byte) (int, error) {
	n := copy(p, d.data)
	d.data = d.data[n:]
	return n, d.err
}

type emptyReader struct{}

func (emptyReader) Read([]byte) (int, error) { return 0, nil }

func TestReaderLongStream(t *testing.T) {
	// Many events through a small buffer exercise compaction and growth.
	var in bytes.Buffer
	for i := range 2000 {
		in.WriteString("data: ")
		in.WriteString(strings.Repeat("abc", i%700))
		in.WriteString("\n\n")
	}
	want := in.String()
	for _, rd := range readers {
		t.Run(rd.name, func(t *testing.T) {
			got, err := readAll(sse.NewReader(rd.wrap(strings.NewReader(want))))
			require.ErrorIs(t, err, io.EOF)
			require.Len(t, got, 2000)
			var raw strings.Builder
			for i, e := range got {
				raw.WriteString(e.Raw)
				assert.Equal(t, strings.Repeat("abc", i%700), e.Data)
			}
			assert.Equal(t, want, raw.String())
		})
	}
}

func TestReaderCROnlyStreamWithLateLF(t *testing.T) {
	// Many '\r'-terminated events followed by a single '\n': each line must
	// not trigger a new search for that distant '\n' (this would be
	// quadratic and never finish in a test run).
	const n = 50000
	in := strings.Repeat("data: x\r\r", n) + "\n"
	r := sse.NewReader(strings.NewReader(in))
	count := 0
	for {
		e, err := r.Next()
		if err == io.EOF {
			break
		}
		require.NoError(t, err)
		if e.HasData {
			count++
			require.Equal(t, "x", string(e.Data))
		}
	}
	assert.Equal(t, n, count)
}

// TestReaderWithBuffer reads into a given buffer, and into a larger one it
// grows for an event that does not fit; Buffer hands back the one in use.
func TestReaderWithBuffer(t *testing.T) {
	small := "data: a\n\n"
	big := "data: " + strings.Repeat("x", 20<<10) + "\n\n"
	buf := make([]byte, 0, 8<<10)
	r := sse.NewReader(strings.NewReader(small), sse.WithBuffer(buf))
	e, err := r.Next()
	require.NoError(t, err)
	assert.Equal(t, "a", string(e.Data))
	assert.Same(t, &buf[:1][0], &e.Raw[0], "read into the given buffer")
	_, err = r.Next()
	assert.ErrorIs(t, err, io.EOF)
	assert.Equal(t, cap(buf), cap(r.Buffer()))
	assert.Empty(t, r.Buffer())

	r = sse.NewReader(iotest.HalfReader(strings.NewReader(small+big)), sse.WithBuffer(buf))
	for _, want := range []int{1, 20 << 10} {
		e, err := r.Next()
		require.NoError(t, err)
		assert.Len(t, e.Data, want)
	}
	assert.Greater(t, cap(r.Buffer()), cap(buf), "grew past the given buffer")
	assert.Nil(t, sse.NewReader(strings.NewReader("")).Buffer(), "no buffer before a read")
}

// TestReaderReady reports a buffered block only when its blank line has
// been read.
func TestReaderReady(t *testing.T) {
	for _, tt := range []struct {
		in    string
		ready bool
	}{
		{"data: a\n\ndata: b\n\n", true},
		{"data: a\n\ndata: b\n", false},
		{"data: a\n\ndata: b\r\n\r\n", true},
		{"data: a\n\ndata: b\r\r", true},
		{"data: a\n\ndata: b\r\n", false},
		{"data: a\n\n", false},
	} {
		r := sse.NewReader(strings.NewReader(tt.in))
		_, err := r.Next()
		require.NoError(t, err)
		assert.Equal(t, tt.ready, r.Ready(), "%q", tt.in)
	}
}
