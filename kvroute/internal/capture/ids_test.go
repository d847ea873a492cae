package capture_test

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/sse"
)

func TestAppendTokenIDs(t *testing.T) {
	cases := []struct {
		in   string
		want []uint32
		ok   bool
	}{
		{`[]`, []uint32{}, true},
		{`[1,2,3]`, []uint32{1, 2, 3}, true},
		{` [ 151644 , 0,4294967295 ] `, []uint32{151644, 0, 4294967295}, true},
		{`[4294967296]`, nil, false},
		{`[-1]`, nil, false},
		{`[1.0]`, nil, false},
		{`[01]`, nil, false},
		{`[1,]`, nil, false},
		{`[1 2]`, nil, false},
		{`null`, nil, false},
		{`["1"]`, nil, false},
		{`[1]x`, nil, false},
		{``, nil, false},
	}
	for _, c := range cases {
		got, ok := capture.AppendTokenIDs([]uint32{}, []byte(c.in))
		assert.Equal(t, c.ok, ok, c.in)
		if c.ok {
			assert.Equal(t, c.want, got, c.in)
		} else {
			assert.Empty(t, got, "nothing appended on failure: %s", c.in)
		}
	}
}

func FuzzAppendTokenIDs(f *testing.F) {
	for _, s := range []string{`[]`, `[1,2,3]`, ` [ 7 ] `, `[4294967296]`, `[-1]`, `[1e3]`, `[01]`, `[1,]`, `null`,
		`[1,22,333,4444,55555,666666,7777777,88888888,999999999,4294967295,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]`,
		`[1,22,333,4444,55555,666666,7777777,88888888,999999999,4294967296,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17]`,
		`[1,22,333,4444,55555,666666,7777777,88888888,999999999,1,2,3,4,5, 6,7,8,9,10,11,12,13,14,15,16,17,18,19,20]`,
		`[1,22,333,4444,55555,666666,7777777,8888,,8888,999999999,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17,18,19]`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, ok := capture.AppendTokenIDs(nil, b)
		var ref []uint32
		refOK := json.Unmarshal(b, &ref) == nil && ref != nil && !strings.ContainsAny(string(b), ".eE-")
		// encoding/json accepts numbers like 1.0 and 1e3 for integers
		// only when exact; we accept plain digits only, so compare on
		// inputs without fractions, exponents or signs.
		if refOK != ok {
			if !ok && refOK {
				t.Fatalf("%q: rejected, encoding/json gives %v", b, ref)
			}
			t.Fatalf("%q: accepted as %v, encoding/json rejects it", b, got)
		}
		if ok && len(got) != len(ref) {
			t.Fatalf("%q: %v, encoding/json %v", b, got, ref)
		}
		for i := range got {
			if got[i] != ref[i] {
				t.Fatalf("%q: %v, encoding/json %v", b, got, ref)
			}
		}
	})
}

func TestCaptureTokenIDs(t *testing.T) {
	events := []string{
		`{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}],"prompt_token_ids":[1,2,3]}`,
		`{"id":"c","choices":[{"index":0,"delta":{"content":"a"},"finish_reason":null,"token_ids":[4]}]}`,
		`{"id":"c","choices":[{"index":0,"delta":{"content":" b"},"finish_reason":null,"token_ids":[5,6]}]}`,
		`{"id":"c","choices":[{"index":0,"delta":{},"finish_reason":"stop","token_ids":[7]}],"kv_transfer_params":{"remote_engine_id":"d"}}`,
		`[DONE]`,
	}
	for _, strip := range []bool{true, false} {
		c := capture.NewChunks(capture.WithTokenIDs(strip))
		var out strings.Builder
		for _, d := range events {
			b, err := c.Forward(sse.Event{Raw: []byte("data: " + d + "\n\n"), Data: []byte(d), HasData: true})
			require.NoError(t, err)
			out.Write(b)
		}
		assert.Equal(t, []uint32{1, 2, 3}, promptIDs(c))
		assert.Equal(t, []uint32{4, 5, 6, 7}, genIDs(c))
		assert.True(t, hasIDs(c))
		assert.Equal(t, `{"remote_engine_id":"d"}`, string(c.Handle()))
		assert.NotContains(t, out.String(), "kv_transfer_params")
		if strip {
			assert.NotContains(t, out.String(), "token_ids")
			assert.Contains(t, out.String(), `"content":" b"`, "everything else is kept")
		} else {
			assert.Contains(t, out.String(), `"token_ids":[5,6]`)
		}
	}
	t.Run("malformed ids", func(t *testing.T) {
		c := capture.NewChunks(capture.WithTokenIDs(true))
		d := `{"choices":[{"index":0,"token_ids":[1,"x"]}],"prompt_token_ids":[1]}`
		_, err := c.Forward(sse.Event{Raw: []byte("data: " + d + "\n\n"), Data: []byte(d), HasData: true})
		require.NoError(t, err)
		assert.False(t, hasIDs(c), "ids that cannot be read are no ids")
	})
}

func TestStripTokenIDs(t *testing.T) {
	in := `{"id":"x","choices":[{"index":0,"message":{"content":"hi"},"token_ids":[1,2],"prompt_token_ids":[3]},{"index":1,"token_ids":null}],"prompt_token_ids":[9,8],"usage":{"prompt_tokens":2}}`
	out, err := capture.StripTokenIDs([]byte(in))
	require.NoError(t, err)
	assert.JSONEq(t, `{"id":"x","choices":[{"index":0,"message":{"content":"hi"}},{"index":1}],"usage":{"prompt_tokens":2}}`, string(out))
	same := `{"id":"x","choices":[{"index":0}]}`
	out, err = capture.StripTokenIDs([]byte(same))
	require.NoError(t, err)
	assert.Equal(t, same, string(out))
	_, err = capture.StripTokenIDs([]byte(`[1]`))
	assert.Error(t, err)
}

// TestCaptureUseIDBuffer parses the prompt's ids into the given slice when
// it has room, and into a new one when it has not.
func TestCaptureUseIDBuffer(t *testing.T) {
	chunk := func(ids string) sse.Event {
		d := `{"choices":[{"index":0,"delta":{"content":""}}],"prompt_token_ids":` + ids + `}`
		return sse.Event{Data: []byte(d), Raw: []byte("data: " + d + "\n\n"), HasData: true}
	}
	buf := make([]uint32, 0, 8)
	c := capture.NewChunks(capture.WithTokenIDs(true))
	assert.Nil(t, promptIDs(c), "none seen")
	c.UseIDBuffer(buf)
	assert.Nil(t, promptIDs(c), "none seen, buffer or not")
	_, err := c.Forward(chunk("[1,2,3]"))
	require.NoError(t, err)
	assert.Equal(t, []uint32{1, 2, 3}, promptIDs(c))
	assert.Same(t, &buf[:1][0], &promptIDs(c)[0], "parsed into the buffer")

	c = capture.NewChunks(capture.WithTokenIDs(true))
	c.UseIDBuffer(make([]uint32, 0, 1))
	_, err = c.Forward(chunk("[4,5,6,7]"))
	require.NoError(t, err)
	assert.Equal(t, []uint32{4, 5, 6, 7}, promptIDs(c), "grown past a small buffer")
}

// FuzzCapturePromptIDs checks the prompt ids a Capture converts while it
// validates a first chunk against validating it and then reading every
// top-level prompt_token_ids member with AppendTokenIDs.
func FuzzCapturePromptIDs(f *testing.F) {
	for _, s := range []string{
		`{"prompt_token_ids":[1,2,3],"choices":[]}`, `{"a":1,"prompt_token_ids":[ 151644 , 0 ]}`,
		`{"prompt_token_ids":[1,2}`, `{"prompt_token_ids":[1],"prompt_token_ids":[2]}`, `{"prompt\u005ftoken_ids":[7]}`,
		`{"prompt_token_ids":[1.0]}`, `{"prompt_token_ids":null}`, `{"prompt_token_ids":[4294967296]}`,
		`{"prompt\u005ftoken_ids":[7],"prompt_token_ids":[1,2,3,4,5,6,7,8,9]}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		if t := bytes.TrimLeft(data, " \t"); bytes.ContainsAny(data, "\r\n") || bytes.Contains(data, []byte("choices")) || len(t) > 0 && t[0] == '[' {
			// Only an object's top-level prompt ids are compared here.
			return
		}
		if len(data) == 0 || string(data) == "[DONE]" {
			return // no JSON: nothing to read
		}
		c := capture.NewChunks(capture.WithTokenIDs(true))
		c.UseIDBuffer(make([]uint32, 0, 4))
		_, err := c.Forward(sse.Event{Raw: []byte("data: " + string(data) + "\n\n"), Data: data, HasData: true})
		_, err2 := c.Forward(sse.Event{Raw: []byte("data: {\"choices\":[{\"index\":0,\"token_ids\":[9]}]}\n\n"), Data: []byte(`{"choices":[{"index":0,"token_ids":[9]}]}`), HasData: true})
		require.NoError(t, err2)

		// The reference: validate, then read each member. Data that is
		// not JSON is refused (the stream ends there), and so is JSON with
		// a member only handles have.
		var ref []uint32
		saw, bad := false, false
		read := func(k string, v []byte) error {
			if k != capture.PromptTokenIDsKey || jsonraw.IsNull(v) {
				return nil
			}
			if ids, ok := capture.AppendTokenIDs(nil, v); ok {
				ref, saw = ids, true
			} else {
				bad = true
			}
			return nil
		}
		o, perr := jsonraw.Parse(data)
		if perr != nil && !errors.Is(perr, jsonraw.ErrNotObject) {
			if !errors.Is(err, sse.ErrMalformedData) {
				t.Fatalf("%q: Forward err %v, reference %v", data, err, perr)
			}
			return
		}
		if err != nil {
			if !errors.Is(err, sse.ErrMalformedData) || !sse.NamesHandleMember(data) {
				t.Fatalf("%q: Forward err %v on valid JSON", data, err)
			}
			return
		}
		if perr == nil {
			for i := range o.Len() {
				_ = read(o.Member(i))
			}
		}
		got := promptIDs(c)
		if (got != nil) != saw || hasIDs(c) != (saw && !bad) {
			t.Fatalf("%q: ids %v (has %v), reference %v saw %v bad %v", data, got, hasIDs(c), ref, saw, bad)
		}
		if saw && !bad {
			require.Equal(t, ref, got, "%q", data)
		}
	})
}

// TestCaptureExpectPromptIDs takes a first chunk's prompt ids as the
// expected ones only when their text is the expected text byte for byte,
// and otherwise parses them as without the expectation.
func TestCaptureExpectPromptIDs(t *testing.T) {
	known := []uint32{151644, 872, 198, 9707}
	raw := []byte(`[151644,872,198,9707]`)
	chunk := func(d string) sse.Event {
		return sse.Event{Data: []byte(d), Raw: []byte("data: " + d + "\n\n"), HasData: true}
	}
	top := func(ids string) string {
		return `{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":""}}],"prompt_token_ids":` + ids + `}`
	}
	for _, c := range []struct {
		name, data string
		want       []uint32 // nil: no ids, or ids that cannot be read
		expected   bool
	}{
		{"equal", top(`[151644,872,198,9707]`), known, true},
		{"equal, spaced around", `{"prompt_token_ids": [151644,872,198,9707] ,"choices":[]}`, known, true},
		{"one id differs", top(`[151644,872,198,9708]`), []uint32{151644, 872, 198, 9708}, false},
		{"spacing differs", top(`[151644, 872,198,9707]`), known, false},
		{"longer", top(`[151644,872,198,9707,1]`), []uint32{151644, 872, 198, 9707, 1}, false},
		{"shorter", top(`[151644,872,198]`), []uint32{151644, 872, 198}, false},
		{"in choice 0", `{"choices":[{"index":0,"text":"","prompt_token_ids":[151644,872,198,9707]}]}`, known, true},
		{"a duplicate", `{"prompt_token_ids":[151644,872,198,9707],"prompt_token_ids":[1],"choices":[]}`, []uint32{1}, false},
	} {
		for _, strip := range []bool{true, false} {
			name := fmt.Sprintf("%s/strip=%v", c.name, strip)
			ref := capture.NewChunks(capture.WithTokenIDs(strip))
			cp := capture.NewChunks(capture.WithTokenIDs(strip))
			cp.ExpectPromptIDs(raw, known)
			wantOut, wantErr := ref.Forward(chunk(c.data))
			out, err := cp.Forward(chunk(c.data))
			require.Equal(t, wantErr, err, name)
			require.Equal(t, string(wantOut), string(out), name)
			require.Equal(t, promptIDs(ref), promptIDs(cp), name)
			if c.want != nil {
				assert.Equal(t, c.want, promptIDs(cp), name)
			}
			assert.Equal(t, c.expected, cp.PromptIDsExpected(), name)
			if c.expected {
				assert.Same(t, &known[0], &promptIDs(cp)[0], "%s: the caller's ids, not a copy", name)
			}
			require.Equal(t, []uint32{151644, 872, 198, 9707}, known, "%s: the caller's ids are never written", name)
		}
	}
	t.Run("truncated", func(t *testing.T) {
		for _, d := range []string{`{"prompt_token_ids":[151644,872,198,9707]`, `{"prompt_token_ids":[151644,872,198,9707`, `{"prompt_token_ids":[151644,872,198,9707]]}`} {
			ref := capture.NewChunks(capture.WithTokenIDs(true))
			cp := capture.NewChunks(capture.WithTokenIDs(true))
			cp.ExpectPromptIDs(raw, known)
			_, wantErr := ref.Forward(chunk(d))
			_, err := cp.Forward(chunk(d))
			require.Error(t, err, d)
			assert.Equal(t, wantErr.Error(), err.Error(), d)
			assert.Equal(t, promptIDs(ref), promptIDs(cp), d)
		}
	})
	t.Run("first data event only", func(t *testing.T) {
		cp := capture.NewChunks(capture.WithTokenIDs(true))
		cp.ExpectPromptIDs(raw, known)
		_, err := cp.Forward(sse.Event{Raw: []byte(": ping\n\n")})
		require.NoError(t, err)
		_, err = cp.Forward(chunk(`{"choices":[{"index":0,"delta":{"content":"a"}}]}`))
		require.NoError(t, err)
		// After a data event the text is no longer compared (the caller
		// may reuse it): the ids are parsed.
		_, err = cp.Forward(chunk(top(`[151644,872,198,9707]`)))
		require.NoError(t, err)
		assert.Equal(t, known, promptIDs(cp))
		assert.False(t, cp.PromptIDsExpected())
		assert.NotSame(t, &known[0], &promptIDs(cp)[0])
	})
	t.Run("without WithTokenIDs", func(t *testing.T) {
		cp := capture.NewChunks()
		cp.ExpectPromptIDs(raw, known)
		_, err := cp.Forward(chunk(top(`[151644,872,198,9707]`)))
		require.NoError(t, err)
		assert.Nil(t, promptIDs(cp))
		assert.False(t, cp.PromptIDsExpected())
	})
}

// FuzzCaptureExpectPromptIDs checks a Capture given the expected prompt
// ids (ExpectPromptIDs) against one without them, itself checked against
// validate-then-parse by FuzzCapturePromptIDs: the same bytes forwarded,
// errors, prompt ids and HasTokenIDs for a first chunk and the next one;
// when the ids were taken as the expected ones, the chunk's value is their
// text byte for byte. The expected text is the fuzzer's when it is an id
// array, else the ids' canonical spelling.
func FuzzCaptureExpectPromptIDs(f *testing.F) {
	for _, s := range []struct{ data, known string }{
		{`{"prompt_token_ids":[1,2,3],"choices":[]}`, `[1,2,3]`},
		{`{"prompt_token_ids":[1,2,4],"choices":[]}`, `[1,2,3]`},
		{`{"prompt_token_ids":[1, 2,3],"choices":[]}`, `[1,2,3]`},
		{`{"prompt_token_ids":[1,2,3]`, `[1,2,3]`},
		{`{"prompt_token_ids":[1,2,3`, `[1,2,3]`},
		{`{"prompt_token_ids":[1,2,3],"prompt_token_ids":[1,2,3]}`, `[1,2,3]`},
		{`{"prompt\u005ftoken_ids":[1,2,3]}`, `[1,2,3]`},
		{`{"choices":[{"index":0,"prompt_token_ids":[1,2,3],"token_ids":[4]}]}`, `[1,2,3]`},
		{`{"choices":[{"index":1,"prompt_token_ids":[1,2,3]}]}`, `[1,2,3]`},
		{`{"prompt_token_ids":[],"kv_transfer_params":{"a":1}}`, `[]`},
	} {
		f.Add([]byte(s.data), []byte(s.known), true)
		f.Add([]byte(s.data), []byte(s.known), false)
	}
	f.Fuzz(func(t *testing.T, data, knownIn []byte, strip bool) {
		if bytes.ContainsAny(data, "\r\n") {
			return // one data line
		}
		known, ok := capture.AppendTokenIDs(nil, knownIn)
		raw := knownIn
		if !ok || len(knownIn) == 0 || knownIn[0] != '[' || knownIn[len(knownIn)-1] != ']' {
			raw = []byte{'['}
			for i, id := range known {
				if i > 0 {
					raw = append(raw, ',')
				}
				raw = strconv.AppendUint(raw, uint64(id), 10)
			}
			raw = append(raw, ']')
		}
		ev := func(d []byte) sse.Event {
			return sse.Event{Raw: []byte("data: " + string(d) + "\n\n"), Data: d, HasData: true}
		}
		next := []byte(`{"choices":[{"index":0,"token_ids":[9],"delta":{"content":"x"}}]}`)
		ref := capture.NewChunks(capture.WithTokenIDs(strip))
		ref.UseIDBuffer(make([]uint32, 0, 4))
		cp := capture.NewChunks(capture.WithTokenIDs(strip))
		cp.UseIDBuffer(make([]uint32, 0, 4))
		rawCopy, knownCopy := bytes.Clone(raw), slices.Clone(known)
		cp.ExpectPromptIDs(raw, known)
		for _, d := range [][]byte{data, next} {
			wantOut, wantErr := ref.Forward(ev(d))
			out, err := cp.Forward(ev(d))
			if (err == nil) != (wantErr == nil) || (err != nil && err.Error() != wantErr.Error()) {
				t.Fatalf("%q: err %v, without the expectation %v", d, err, wantErr)
			}
			if !bytes.Equal(out, wantOut) {
				t.Fatalf("%q: forwarded %q, without the expectation %q", d, out, wantOut)
			}
		}
		if !bytes.Equal(raw, rawCopy) || !slices.Equal(known, knownCopy) {
			t.Fatal("the expected text or ids were changed")
		}
		got, want := promptIDs(cp), promptIDs(ref)
		if (got == nil) != (want == nil) || !slices.Equal(got, want) || hasIDs(cp) != hasIDs(ref) {
			t.Fatalf("%q: ids %v (has %v), without the expectation %v (has %v)", data, got, hasIDs(cp), want, hasIDs(ref))
		}
		if cp.PromptIDsExpected() {
			if !bytes.Contains(data, raw) {
				t.Fatalf("%q: taken as the expected %q", data, raw)
			}
			if len(known) > 0 && &got[0] != &known[0] {
				t.Fatal("expected ids copied")
			}
		}
	})
}

// promptIDs returns the prompt's token ids c collected (the first result
// of IDs).
func promptIDs(c *capture.Chunks) []uint32 {
	p, _, _ := c.IDs()
	return p
}

// genIDs returns the generated token ids c collected (the second result of
// IDs).
func genIDs(c *capture.Chunks) []uint32 {
	_, g, _ := c.IDs()
	return g
}

// hasIDs reports whether c collected both the prompt's and the generated
// token ids (the third result of IDs).
func hasIDs(c *capture.Chunks) bool {
	_, _, ok := c.IDs()
	return ok
}
