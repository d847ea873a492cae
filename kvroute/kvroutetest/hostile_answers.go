package kvroutetest

import (
	"fmt"
	"net/http"
	"strconv"
	"strings"
)

// apiAnswer is one API's well-formed decode answer without a handle: a
// body, and a stream of events, with where vLLM (or, for Messages streams,
// where a router would look) puts the handle.
type apiAnswer struct {
	body   jobj
	events []sevent
	// final is the stream event that carries the handle; target the
	// pre-order index of the object in it that holds the member.
	final, target int
}

// sevent is one stream event: its name (none when "") and data.
type sevent struct {
	name string
	data jnode
}

func num(n int) jraw { return jraw(strconv.Itoa(n)) }

const null = jraw("null")

func answerFor(path string) apiAnswer {
	switch path {
	case PathCompletions:
		head := jobj{{"id", jstr("cmpl-h")}, {"object", jstr("text_completion")}, {"created", num(1)}, {"model", jstr("m")}}
		usage := jmember{"usage", jobj{{"prompt_tokens", num(5)}, {"completion_tokens", num(1)}, {"total_tokens", num(6)}}}
		choice := func(text string, finish jraw) jmember {
			return jmember{"choices", jarr{jobj{{"index", num(0)}, {"text", jstr(text)}, {"logprobs", null}, {"finish_reason", finish}, {"stop_reason", null}}}}
		}
		return apiAnswer{
			body: append(append(jobj{}, head...), choice("hello", jstr("stop")), usage),
			events: []sevent{
				{"", append(append(jobj{}, head...), choice("hello", null))},
				{"", append(append(jobj{}, head...), choice("", jstr("stop")), usage)},
				{"", jraw("[DONE]")},
			},
			final: 1,
		}
	case PathResponses:
		resp := func(status string, output jnode, usage bool) jobj {
			o := jobj{{"id", jstr("resp_h")}, {"object", jstr("response")}, {"created_at", num(1)}, {"model", jstr("m")},
				{"status", jstr(status)}, {"output", output}, {"metadata", null}, {"tools", jarr{}}}
			if usage {
				o = append(o, jmember{"usage", jobj{{"input_tokens", num(5)}, {"output_tokens", num(1)}, {"total_tokens", num(6)},
					{"input_tokens_details", jobj{{"cached_tokens", num(0)}}}, {"output_tokens_details", jobj{{"reasoning_tokens", num(0)}}}}})
			}
			return o
		}
		output := jarr{jobj{{"id", jstr("msg_h")}, {"type", jstr("message")}, {"role", jstr("assistant")}, {"status", jstr("completed")},
			{"content", jarr{jobj{{"type", jstr("output_text")}, {"text", jstr("hello")}, {"annotations", jarr{}}}}}}}
		return apiAnswer{
			body: resp("completed", output, true),
			events: []sevent{
				{"response.created", jobj{{"type", jstr("response.created")}, {"sequence_number", num(0)}, {"response", resp("in_progress", jarr{}, false)}}},
				{"response.output_text.delta", jobj{{"type", jstr("response.output_text.delta")}, {"sequence_number", num(1)}, {"item_id", jstr("msg_h")},
					{"output_index", num(0)}, {"content_index", num(0)}, {"delta", jstr("hello")}, {"logprobs", jarr{}}}},
				{"response.completed", jobj{{"type", jstr("response.completed")}, {"sequence_number", num(2)}, {"response", resp("completed", output, true)}}},
			},
			final: 2, target: 1,
		}
	case PathMessages:
		return apiAnswer{
			body: jobj{{"id", jstr("msg_h")}, {"type", jstr("message")}, {"role", jstr("assistant")}, {"model", jstr("m")},
				{"content", jarr{jobj{{"type", jstr("text")}, {"text", jstr("hello")}},
					jobj{{"type", jstr("tool_use")}, {"id", jstr("toolu_h")}, {"name", jstr("f")}, {"input", jobj{{"q", jstr("x")}}}}}},
				{"stop_reason", jstr("end_turn")}, {"stop_sequence", null}, {"usage", jobj{{"input_tokens", num(5)}, {"output_tokens", num(1)}}}},
			events: []sevent{
				{"message_start", jobj{{"type", jstr("message_start")}, {"message", jobj{{"id", jstr("msg_h")}, {"type", jstr("message")},
					{"role", jstr("assistant")}, {"content", jarr{}}, {"model", jstr("m")}, {"stop_reason", null}, {"stop_sequence", null},
					{"usage", jobj{{"input_tokens", num(5)}, {"output_tokens", num(0)}}}}}}},
				{"content_block_start", jobj{{"type", jstr("content_block_start")}, {"index", num(0)}, {"content_block", jobj{{"type", jstr("text")}, {"text", jstr("")}}}}},
				{"content_block_delta", jobj{{"type", jstr("content_block_delta")}, {"index", num(0)}, {"delta", jobj{{"type", jstr("text_delta")}, {"text", jstr("hello")}}}}},
				{"content_block_stop", jobj{{"type", jstr("content_block_stop")}, {"index", num(0)}}},
				{"message_delta", jobj{{"type", jstr("message_delta")}, {"delta", jobj{{"stop_reason", jstr("end_turn")}, {"stop_sequence", null}}}, {"usage", jobj{{"output_tokens", num(1)}}}}},
				{"message_stop", jobj{{"type", jstr("message_stop")}}},
			},
			final: 0, target: 1,
		}
	}
	head := jobj{{"id", jstr("chatcmpl-h")}, {"object", jstr("chat.completion")}, {"created", num(1)}, {"model", jstr("m")}}
	chunk := jobj{{"id", jstr("chatcmpl-h")}, {"object", jstr("chat.completion.chunk")}, {"created", num(1)}, {"model", jstr("m")}}
	usage := jmember{"usage", jobj{{"prompt_tokens", num(5)}, {"total_tokens", num(6)}, {"completion_tokens", num(1)}, {"prompt_tokens_details", null}}}
	delta := func(d jobj, finish jraw) jmember {
		return jmember{"choices", jarr{jobj{{"index", num(0)}, {"delta", d}, {"logprobs", null}, {"finish_reason", finish}}}}
	}
	message := jobj{{"role", jstr("assistant")}, {"content", jstr("hello")}, {"tool_calls", jarr{jobj{{"id", jstr("call_h")}, {"type", jstr("function")},
		{"function", jobj{{"name", jstr("f")}, {"arguments", jstr(`{"q":"x"}`)}}}}}}}
	return apiAnswer{
		body: append(append(jobj{}, head...),
			jmember{"choices", jarr{jobj{{"index", num(0)}, {"message", message}, {"logprobs", null}, {"finish_reason", jstr("stop")}, {"stop_reason", null}}}},
			usage, jmember{"prompt_logprobs", null}),
		events: []sevent{
			{"", append(append(jobj{}, chunk...), delta(jobj{{"role", jstr("assistant")}, {"content", jstr("")}}, null))},
			{"", append(append(jobj{}, chunk...), delta(jobj{{"content", jstr("hello")}}, null))},
			{"", append(append(jobj{}, chunk...), delta(jobj{}, jstr("stop")), usage)},
			{"", jraw("[DONE]")},
		},
		final: 2,
	}
}

// encStream writes events as a stream, with line ending eol.
func encStream(evs []sevent, eol string) string {
	var b strings.Builder
	for _, ev := range evs {
		if ev.name != "" {
			b.WriteString("event: " + ev.name + eol)
		}
		b.WriteString("data: " + enc(ev.data) + eol + eol)
	}
	return b.String()
}

// withEvent returns evs with event i's data replaced by d.
func withEvent(evs []sevent, i int, d jnode) []sevent {
	out := append([]sevent(nil), evs...)
	out[i].data = d
	return out
}

var (
	jsonHeader   = http.Header{"Content-Type": {"application/json"}}
	streamHeader = http.Header{"Content-Type": {"text/event-stream; charset=utf-8"}}
)

func headerWith(h http.Header, kv ...string) http.Header {
	out := h.Clone()
	for i := 0; i+1 < len(kv); i += 2 {
		out.Add(kv[i], kv[i+1])
	}
	return out
}

// HostileAnswers returns every malformed decode answer for the API at
// path (PathChat, PathCompletions, PathResponses or PathMessages), as a
// stream when stream is set, each carrying HostileHandle (or its values):
// the handle under a kv_transfer_params key spelled literally or with JSON
// escapes at every object of the answer and of every event; its members
// spread where the wrapper would be; duplicate keys; huge numbers; invalid
// UTF-8; the answer compressed (gzip, br, zstd, deflate) with and without
// Content-Encoding; headers naming the handle; answers that are not JSON;
// error statuses whose bodies echo it; and for streams byte order marks
// before mid-stream lines, events split over several data lines (inside
// a key, and between members), handles in comments, ids, event names and
// unknown fields, CR and CRLF line ends, events after data: [DONE], and a
// stream cut in the middle of an event.
func HostileAnswers(path string, stream bool) []HostileAnswer {
	a := answerFor(path)
	if stream {
		return hostileStreams(path, a)
	}
	return hostileBodies(path, a)
}

func hostileBodies(path string, a apiAnswer) []HostileAnswer {
	var out []HostileAnswer
	clean := []byte(enc(a.body))
	add := func(name string, h http.Header, body string, clean []byte) {
		out = append(out, HostileAnswer{Name: name, Path: path, Status: http.StatusOK, Header: h, Body: []byte(body), Clean: clean})
	}
	top := jmember{kvKey, jraw(HostileHandle)}
	withTop := enc(withLast(a.body, 0, top))
	add("top-level handle", jsonHeader, withTop, clean)

	paths := objectPaths(a.body, "", nil)
	for _, sp := range keySpellings {
		for i, p := range paths {
			add("key "+sp.name+" in "+where(p), jsonHeader, enc(with(a.body, i, jmember{sp.key, jraw(HostileHandle)})), clean)
		}
	}
	for i, p := range paths {
		add("handle members spread in "+where(p), jsonHeader, enc(with(a.body, i, handleMembers(HostileHandle)...)), nil)
		add("handle under another key in "+where(p), jsonHeader, enc(with(a.body, i, jmember{"kv_transfer_params\xff", jraw(HostileHandle)})), nil)
	}

	// Duplicate keys: a null first and the handle last, both spellings,
	// and a second "choices" (or "content", "output") whose element holds
	// the handle.
	add("duplicate key, null then the handle", jsonHeader,
		enc(withLast(with(a.body, 0, jmember{kvKey, null}), 0, top)), clean)
	add("duplicate key in two spellings", jsonHeader,
		enc(withLast(with(a.body, 0, jmember{`\u006bv_transfer_params`, jraw(HostileHandle)}), 0, top)), clean)
	dupKey, dupVal := a.body[len(a.body)-1].key, a.body[len(a.body)-1].val
	dup := withLast(a.body, 0, jmember{dupKey, dupVal})
	n := len(objectPaths(a.body, "", nil))
	dupClean := enc(dup)
	if len(objectPaths(dupVal, "", nil)) > 0 {
		add("duplicate member holding the handle", jsonHeader, enc(with(dup, n, jmember{`\u006bv_transfer_params`, jraw(HostileHandle)})), []byte(dupClean))
	}

	// Huge numbers, in the handle and around it.
	big := strings.Replace(HostileHandle, `"remote_port":47391`, `"remote_port":1e999`, 1)
	big = strings.Replace(big, `[[11,12,13]]`, `[[18446744073709551616,-1,1e400]]`, 1)
	add("huge numbers in the handle", jsonHeader, enc(withLast(a.body, 0, jmember{kvKey, jraw(big)})), clean)
	bigBody := withLast(a.body, 0, jmember{"x_big", jraw("1e99999")}, jmember{"x_long", jraw("123456789012345678901234567890123456789")})
	add("huge numbers around the handle", jsonHeader, enc(with(bigBody, 0, jmember{`\u006bv_transfer_params`, jraw(HostileHandle)})), []byte(enc(bigBody)))

	// Invalid UTF-8 next to the handle.
	bad := withLast(a.body, 0, jmember{"x\xfe", jraw("\"y\xfd\xff\"")})
	add("invalid UTF-8 next to an escaped key", jsonHeader, enc(withLast(bad, 0, jmember{`\u006bv_transfer_params`, jraw(HostileHandle)})), []byte(enc(bad)))

	// Deep nesting.
	deep := jnode(jobj{{`\u006bv_transfer_params`, jraw(HostileHandle)}})
	deepClean := jnode(jobj{})
	for range 64 {
		deep, deepClean = jarr{deep}, jarr{deepClean}
	}
	add("handle 64 arrays deep", jsonHeader, enc(withLast(a.body, 0, jmember{"x_deep", deep})), []byte(enc(withLast(a.body, 0, jmember{"x_deep", deepClean}))))
	add("array of answers", jsonHeader, "["+withTop+"]", []byte("["+string(clean)+"]"))

	// Compressed answers, with and without Content-Encoding.
	raw := []byte(withTop)
	for _, c := range compressions(raw) {
		add(c.name+" with Content-Encoding", headerWith(jsonHeader, "Content-Encoding", c.encoding), string(c.body), nil)
		add(c.name+" without Content-Encoding", jsonHeader, string(c.body), nil)
	}
	add("Content-Encoding identity", headerWith(jsonHeader, "Content-Encoding", "identity"), withTop, clean)

	// Headers that name the handle.
	add("headers naming the handle", headerWith(jsonHeader, "Kv-Transfer-Params", HostileHandle, "X-Remote-Engine-Id", HostileEngineID), withTop, clean)

	// Answers that are not JSON.
	add("not JSON", jsonHeader, "kv_transfer_params="+HostileHandle, nil)
	add("trailing bytes", jsonHeader, withTop+"}x", nil)
	add("byte order mark", jsonHeader, "\xef\xbb\xbf"+withTop, nil)
	add("truncated", jsonHeader, withTop[:len(withTop)-len(HostileHandle)/2], nil)

	// Error statuses whose bodies echo the handle.
	errBody := jobj{{"error", jobj{{"message", jstr("bad request")}, {"type", jstr("BadRequestError")}, {"param", null}, {"code", num(400)}}}}
	for _, status := range []int{http.StatusBadRequest, http.StatusInternalServerError} {
		out = append(out,
			HostileAnswer{Name: "status " + strconv.Itoa(status) + " echoing the handle", Path: path, Status: status, Header: jsonHeader,
				Body: []byte(enc(with(errBody, 1, jmember{`\u006bv_transfer_params`, jraw(HostileHandle)})))},
			HostileAnswer{Name: "status " + strconv.Itoa(status) + " spreading the handle", Path: path, Status: status, Header: jsonHeader,
				Body: []byte(enc(with(errBody, 1, handleMembers(HostileHandle)...)))},
			HostileAnswer{Name: "status " + strconv.Itoa(status) + " not JSON", Path: path, Status: status, Header: jsonHeader,
				Body: []byte("error: kv_transfer_params=" + HostileHandle)})
	}
	return out
}

// where names an object path for answer names.
func where(p string) string {
	if p == "" {
		return "the top level"
	}
	return p
}

type compressed struct {
	name, encoding string
	body           []byte
}

func compressions(b []byte) []compressed {
	return []compressed{
		{"gzip", "gzip", gzipped(b)},
		{"x-gzip", "x-gzip", gzipped(b)},
		{"br", "br", brotliStored(b)},
		{"zstd", "zstd", zstdStored(b)},
		{"deflate", "deflate", zlibbed(b)},
		{"gzip listed with identity", "identity, gzip", gzipped(b)},
	}
}

func hostileStreams(path string, a apiAnswer) []HostileAnswer {
	var out []HostileAnswer
	clean := []byte(encStream(a.events, "\n"))
	add := func(name string, h http.Header, body string, clean []byte) {
		out = append(out, HostileAnswer{Name: name, Path: path, Stream: true, Status: http.StatusOK, Header: h, Body: []byte(body), Clean: clean})
	}
	top := jmember{kvKey, jraw(HostileHandle)}
	final := a.events[a.final].data
	withFinal := withEvent(a.events, a.final, withLast(final, a.target, top))
	base := encStream(withFinal, "\n")
	add("handle in the final event", streamHeader, base, clean)

	for e, ev := range a.events {
		if _, ok := ev.data.(jobj); !ok {
			continue
		}
		for _, sp := range keySpellings {
			for i, p := range objectPaths(ev.data, "", nil) {
				add("event "+strconv.Itoa(e)+": key "+sp.name+" in "+where(p), streamHeader,
					encStream(withEvent(a.events, e, with(ev.data, i, jmember{sp.key, jraw(HostileHandle)})), "\n"), clean)
			}
		}
		for i, p := range objectPaths(ev.data, "", nil) {
			add("event "+strconv.Itoa(e)+": handle members spread in "+where(p), streamHeader,
				encStream(withEvent(a.events, e, with(ev.data, i, handleMembers(HostileHandle)...)), "\n"), nil)
		}
	}

	finalWith := func(m ...jmember) string {
		return encStream(withEvent(a.events, a.final, withLast(final, a.target, m...)), "\n")
	}
	add("duplicate key, null then the handle", streamHeader, finalWith(jmember{kvKey, null}, top), clean)
	add("duplicate key in two spellings", streamHeader, finalWith(jmember{`\u006bv_transfer_params`, jraw(HostileHandle)}, top), clean)
	big := strings.Replace(HostileHandle, `"remote_port":47391`, `"remote_port":1e999`, 1)
	add("huge numbers in the handle", streamHeader, finalWith(jmember{kvKey, jraw(big)}), clean)
	badFinal := withLast(final, 0, jmember{"x\xfe", jraw("\"y\xfd\xff\"")})
	add("invalid UTF-8 next to an escaped key", streamHeader,
		encStream(withEvent(a.events, a.final, withLast(badFinal, 0, jmember{`\u006bv_transfer_params`, jraw(HostileHandle)})), "\n"),
		[]byte(encStream(withEvent(a.events, a.final, badFinal), "\n")))

	// Line structure: byte order marks, split data lines, line ends.
	finalText := enc(withLast(final, a.target, top))
	evLine := func(ev sevent, data string) string {
		s := ""
		if ev.name != "" {
			s = "event: " + ev.name + "\n"
		}
		return s + data
	}
	streamWith := func(finalEvent string) string {
		var b strings.Builder
		for i, ev := range a.events {
			if i == a.final {
				b.WriteString(finalEvent)
				continue
			}
			b.WriteString(encStream([]sevent{ev}, "\n"))
		}
		return b.String()
	}
	// A byte order mark before a data line in the middle of the stream is
	// part of the field name for the specification, but some clients
	// strip it (go-sse does on every line).
	midBOM := "\xef\xbb\xbfdata: " + finalText + "\n\n"
	add("byte order mark before a mid-stream event", streamHeader, encStream(a.events[:1], "\n")+midBOM+encStream(a.events[1:], "\n"), nil)
	add("byte order mark before a continuation data line", streamHeader,
		streamWith(evLine(a.events[a.final], "data: "+enc(final)+"\n\xef\xbb\xbfdata: "+finalText+"\n\n")), nil)
	add("byte order mark at the start of the stream", streamHeader, "\xef\xbb\xbf"+base, clean)

	// The final event split over two data lines: inside the key and inside
	// a handle member's name (the joined data is not JSON), and between
	// members (it is).
	keyAt := strings.Index(finalText, kvKey)
	for _, cut := range []int{keyAt + 1, keyAt + 3, keyAt + len(kvKey) - 1, strings.Index(finalText, "remote_engine_id") + 7, strings.Index(finalText, HostileHost) + 3} {
		add("final event split at byte "+strconv.Itoa(cut), streamHeader,
			streamWith(evLine(a.events[a.final], "data: "+finalText[:cut]+"\ndata: "+finalText[cut:]+"\n\n")), nil)
	}
	comma := keyAt - 2 // the comma before "kv_transfer_params"
	add("final event split between members", streamHeader,
		streamWith(evLine(a.events[a.final], "data: "+finalText[:comma+1]+"\ndata: "+finalText[comma+1:]+"\n\n")), clean)

	// The handle outside the data.
	for _, line := range []string{": " + HostileHandle, ": kv_transfer_params", "id: " + HostileHandle, "event: kv_transfer_params",
		"kv_transfer_params: " + HostileHandle, "retry: " + HostileHandle, ": \\u006bv_transfer_params", ": remote_engine_id " + HostileEngineID,
		": \xff\xfe" + HostileEngineID} {
		add(fmt.Sprintf("line %.24q naming the handle", line), streamHeader,
			streamWith(evLine(a.events[a.final], line+"\ndata: "+enc(final)+"\n\n")), clean)
	}
	add("CR line ends", streamHeader, strings.ReplaceAll(finalWith(jmember{`\u006bv_transfer_params`, jraw(HostileHandle)}), "\n", "\r"), clean)
	add("CRLF line ends", streamHeader, strings.ReplaceAll(finalWith(jmember{`\u006bv_transfer_params`, jraw(HostileHandle)}), "\n", "\r\n"), clean)
	add("not JSON", streamHeader, streamWith(evLine(a.events[a.final], "data: kv_transfer_params="+HostileHandle+"\n\n")), nil)
	add("not JSON, escaped", streamHeader, streamWith(evLine(a.events[a.final], `data: {\u006bv_transfer_params: `+HostileHandle+"\n\n")), nil)
	add("array data", streamHeader, streamWith(evLine(a.events[a.final], "data: ["+finalText+"]\n\n")), nil)
	add("event after the last", streamHeader, encStream(a.events, "\n")+"data: "+enc(jobj{top})+"\n\n", nil)

	// Cut in the middle of an event.
	add("cut inside the final event", streamHeader, streamWith(evLine(a.events[a.final], "data: "+finalText)), nil)
	add("cut inside the handle", streamHeader, streamWith(evLine(a.events[a.final], "data: "+finalText[:strings.Index(finalText, HostileHost)+5])), nil)
	add("cut after the final event's data line", streamHeader, streamWith(evLine(a.events[a.final], "data: "+finalText+"\n")), nil)

	// Compressed streams, headers.
	for _, c := range compressions([]byte(base)) {
		add(c.name+" with Content-Encoding", headerWith(streamHeader, "Content-Encoding", c.encoding), string(c.body), nil)
		add(c.name+" without Content-Encoding", streamHeader, string(c.body), nil)
	}
	add("headers naming the handle", headerWith(streamHeader, "Kv-Transfer-Params", HostileHandle, "X-Remote-Engine-Id", HostileEngineID), base, clean)
	return out
}
