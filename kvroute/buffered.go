package kvroute

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"sort"
	"strings"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/kvroute/internal/streamsynth"
)

// Buffered streams (WithDecodeMemory's BufferStreams).
//
// Stock vLLM puts no decode handle in chat and completions streams (that
// needs the unmerged PR #40186) and none ever in Messages streams, so a
// streaming client on stock engines never reuses KV. For the APIs listed
// in BufferStreams, a streamed turn whose decode engine's streams of that
// API carry no handle runs its decode leg non-streaming: "stream": false
// and no stream_options (vLLM refuses them on a non-streaming request).
// The answer's body carries D's handle: it is read into one buffer bounded
// by WithLimits' Body, like any non-streaming answer, its handle taken and
// retained, its kv_transfer_params removed (sse.Scrub) and the token ids
// the client did not ask for stripped, and it is then written to the
// client as the API's own stream (kvroute/internal/streamsynth), from that
// one buffer. Headers: the answer's own, as a stream's (text/event-stream,
// no Content-Length); X-Bidikv-Reuse and X-Request-Id as for any turn.
//
// A Messages stream is always buffered: vLLM's never carry a handle. A
// chat or completions stream is buffered when its decode engine's streams
// of that API are known to carry none (learned.go), and never when they
// are known to carry one (vLLM PR #40186). Before either is known, one
// stream per engine and API at a time goes as the client asked, to show
// it: on stock engines that one turn is not retained (its conversation's
// next turn misses), and every later one is buffered; meanwhile other
// turns are buffered. A Responses stream never is: its response.completed
// carries the handle.
// Nothing is buffered that could not be retained: turns with reuse off,
// decode-local turns, turns whose prefill engine gave no handle, n above 1.
//
// The trade: the first token arrives with the last. The turn's TTFT is its
// whole decode, and every later turn of the conversation reuses KV; it
// suits headless agents (Claude Code with -p, CI agents), where the whole
// turn's time is what counts, not a person watching text appear. No
// keep-alive is sent while the answer is awaited: the response's headers
// come with it, so an engine's error reaches the client as for any
// streaming request that failed before its first event.

// errNotAnswer fails a buffered turn whose decode answer is not an answer
// of the API (it cannot be written as the API's stream): a 502 before any
// byte reached the client, not redone (the same request would likely get
// the same answer).
var errNotAnswer = errors.New("kvroute: the decode engine's answer is not an answer of the API; it cannot be written as the API's stream")

// buffered is a streamed turn's decode answer held whole, to be written as
// the API's stream: by WriteTo from body directly, or by Next event by
// event from the stream made once.
type buffered struct {
	api    streamsynth.API
	opt    streamsynth.Options
	body   []byte // the scrubbed answer
	events []byte // Next: the events not returned yet
	made   bool   // Next made events
	ended  bool
}

// bufferFor returns how the decode leg of t to ep is buffered, or nil when
// it streams as the client asked: see the comment above.
func bufferFor(t *turn, ep *endpoint, pHandle []byte) *buffered {
	r := t.r
	a, ok := r.cfg.bufferStreams[t.req.Path]
	if !ok || !t.stream || pHandle == nil || !r.cfg.reuse {
		return nil
	}
	if t.sampling != "" {
		// An earlier leg of the turn claimed another engine's sample.
		r.learned.unsample(t.sampling, t.req.Path)
		t.sampling = ""
	}
	if t.req.api.streamHandles {
		switch r.learned.streams(ep.url, t.req.Path) {
		case capability.Present:
			return nil // the engine streams its handle (vLLM PR #40186)
		case capability.Unknown:
			if r.learned.sample(ep.url, t.req.Path) {
				t.sampling = ep.url // this stream shows whether it does
				return nil
			}
		}
	}
	if v, ok := t.req.Field("n"); ok && !jsonraw.IsNull(v) {
		if n, ok := lenientInt(v); !ok || n != 1 {
			return nil // never retained (RefuseN)
		}
	}
	return &buffered{api: a, opt: streamOptions(t.req)}
}

// streamOptions reads the client's stream_options as vLLM reads flags.
func streamOptions(req *Request) streamsynth.Options {
	var o streamsynth.Options
	so, ok := req.Field("stream_options")
	if !ok || len(so) == 0 || so[0] != '{' {
		return o
	}
	if v, ok := jsonraw.Lookup(so, "include_usage"); ok {
		o.IncludeUsage, _ = lenientBool(v)
	}
	if v, ok := jsonraw.Lookup(so, "continuous_usage_stats"); ok {
		o.ContinuousUsage, _ = lenientBool(v)
	}
	return o
}

// Members removed from the client's body on a buffered decode leg, and
// the member set.
var (
	bufferedDrop = append(append([]string(nil), decodeDrop...), "stream_options")
	bufferedSet  = jsonraw.Member{Key: "stream", Value: jsonFalse}
)

// check validates a buffered turn's scrubbed answer before anything of it
// is retained: an answer that cannot be written as the API's stream fails
// the turn.
func (b *buffered) check(r *Response, out []byte, isObject bool) error {
	err := errNotAnswer
	if isObject {
		if err = b.api.Write(io.Discard, out, b.opt); err == nil {
			return nil
		}
		err = fmt.Errorf("%w: %w", errNotAnswer, err)
	}
	return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: err}
}

// start makes r, whose body holds the answer, the API's stream.
func (b *buffered) start(r *Response) {
	t := r.t
	b.body, r.Body = r.Body, nil
	streamsynth.SetHeader(r.Header)
	t.rec.Buffered = true
	t.rec.TTFT = t.since() // the first event leaves with the answer
	t.r.stats.buffered.Add(1)
}

// next returns the stream's next event: the events are made on the first
// call, into one buffer that replaces the answer's.
func (b *buffered) next(r *Response) ([]byte, error) {
	if !b.made {
		b.made = true
		var buf bytes.Buffer
		buf.Grow(len(b.body) + 1024)
		if err := b.api.Write(&buf, b.body, b.opt); err != nil {
			b.end(r)
			return nil, err
		}
		b.events, b.body = buf.Bytes(), nil
	}
	i := bytes.Index(b.events, []byte("\n\n"))
	if i < 0 {
		b.end(r)
		return nil, io.EOF
	}
	ev := b.events[:i+2]
	b.events = b.events[i+2:]
	r.t.rec.Bytes += int64(len(ev))
	return ev, nil
}

// writeTo writes the stream to w, flushing it at the end: from the answer
// itself, or the events Next has not returned.
func (b *buffered) writeTo(r *Response, w io.Writer) (int64, error) {
	cw := &countingWriter{w: w}
	var err error
	if b.made {
		if _, err = cw.Write(b.events); err == nil {
			err = cw.Flush()
		}
		b.events = nil
	} else {
		err = b.api.Write(cw, b.body, b.opt)
	}
	r.t.rec.Bytes += cw.n
	b.end(r)
	return cw.n, err
}

// end ends the turn once: the answer was reported to the retainer when
// Do handed it on (Response.to).
func (b *buffered) end(r *Response) {
	if b.ended {
		return
	}
	b.ended, b.body, b.events = true, nil, nil
	if r.err == nil {
		r.err = io.EOF
	}
	r.rt.end("", nil)
}

// countingWriter counts what goes to w and flushes w as the stream's
// writer would (http.ResponseWriter, Flush() error, http.Flusher).
type countingWriter struct {
	w io.Writer
	n int64
}

func (c *countingWriter) Write(p []byte) (int, error) {
	n, err := c.w.Write(p)
	c.n += int64(n)
	return n, err
}

// Flush flushes the underlying writer when it can be flushed.
func (c *countingWriter) Flush() error { return streamsynth.Flush(c.w) }

// logBuffering states the trade once, when New is called with
// BufferStreams.
func logBuffering(l *logger, paths map[string]streamsynth.API) {
	if len(paths) == 0 {
		return
	}
	list := make([]string, 0, len(paths))
	for p := range paths {
		list = append(list, p)
	}
	sort.Strings(list)
	l.Info("kvroute: buffered streams: a streamed turn on these APIs whose decode engine's streams carry no handle runs its decode leg non-streaming and is written to the client as the API's stream once the answer is complete: the first token arrives with the last (TTFT is the whole decode), and the next turn reuses KV",
		slog.String("apis", strings.Join(list, " ")))
}
