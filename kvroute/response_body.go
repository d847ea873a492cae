package kvroute

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/kvroute/internal/kvhandle"
	"github.com/bidikv/bidikv/sse"
)

// readBody reads a non-streaming answer, takes its handle, and keeps for
// the caller what sse.Scrub lets through: every kv_transfer_params
// removed, at any depth; an answer that is not JSON, or holds members
// only handles have elsewhere, fails closed.
//
// What the retain phase needs of the answer waits in r.got until Do hands
// the Response the turn's retainer (to). For a buffered stream (buf), the
// answer must be one the API's stream can be written from before anything
// of it is retained, and the turn ends when the stream has been written.
//
// The answer's bytes are charged to WithLimits' ChargeAnswer as they are
// held (answerCharge); a failed read gives them back at once, a read
// answer when the Response is closed.
func (r *Response) readBody(ctx context.Context, buf *buffered, declared int64) (err error) {
	defer r.release()
	r.charge = answerCharge{fn: r.t.r.cfg.limits.ChargeAnswer, ctx: ctx}
	defer func() {
		if err != nil {
			r.charge.giveBack()
		}
	}()
	limit := r.t.r.cfg.maxBodyBytes
	var free int64 // charged before it arrives
	if declared > 0 && declared <= limit {
		if !r.charge.take(declared) {
			return errAnswerCharge
		}
		free = declared
	}
	// A declared length is read into one buffer of that size, allocated
	// once it is charged.
	b, err := readSized(&chargedReader{r: r.body, c: &r.charge, free: free}, declared, limit, nil)
	if errors.Is(err, errAnswerCharge) {
		return err
	}
	if err != nil {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: err}
	}
	// D's handle's block list is read as the answer is validated.
	var obj jsonraw.Object
	blocks, perr := kvhandle.ResetAnswer(&obj, b)
	isObject := perr == nil
	if !isObject && !errors.Is(perr, jsonraw.ErrNotObject) {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: fmt.Errorf("%w: not JSON", errUnsafeAnswer)}
	}
	var handle []byte
	var ids tokenIDs
	if isObject {
		if h, ok := obj.Get(kvKey); ok && !jsonraw.IsNull(h) {
			handle = append([]byte(nil), h...)
		}
		if r.added || r.asked {
			ids = bodyTokenIDs(obj, &r.t.bufs)
			r.t.bufs.promptIDs = ids.prompt
		}
		if r.added {
			// The client did not ask for token ids: they never reach it.
			b, _ = capture.StripTokenIDs(b)
		}
	}
	out, _, err := sse.Scrub(nil, b)
	if err != nil {
		return &UpstreamError{Phase: PhaseDecode, Endpoint: r.ep.url, Status: r.StatusCode, Err: fmt.Errorf("%w: %w", errUnsafeAnswer, err)}
	}
	if buf != nil {
		if err := buf.check(r, out, isObject); err != nil {
			return err
		}
	}
	r.Body = out
	r.Header.Del("Content-Length")
	if !isObject {
		// Valid JSON but not an object: nothing to capture.
		r.got = answer{notJSON: true}
		return nil
	}
	r.got = answer{decode: r.ep.url, added: r.added, asked: r.asked, handle: handle, blocks: blocks,
		reply: r.t.req.api.impl.bodyReply(obj), ids: ids}
	r.buf = buf
	return nil
}

// bodyTokenIDs reads the token ids of a non-streaming answer: the prompt's
// at the top level (chat) or in choice 0 (completions), the generated ones
// in choice 0.
func bodyTokenIDs(obj jsonraw.Object, bufs *turnBufs) tokenIDs {
	var prompt, gen []byte
	if v, ok := obj.Get(capture.PromptTokenIDsKey); ok {
		prompt = v
	}
	choices, _ := obj.Get("choices")
	_ = jsonraw.Elements(choices, func(c []byte) error {
		if v, ok := jsonraw.Lookup(c, capture.PromptTokenIDsKey); ok && prompt == nil {
			prompt = v
		}
		gen, _ = jsonraw.Lookup(c, capture.TokenIDsKey)
		return errStop
	})
	var p []uint32
	okP := false
	if bufs.renderText != nil && bufs.rendered != nil && bytes.Equal(prompt, bufs.renderText) {
		// Spelled as the render answer's ids: the rendered ones (kept
		// until the turn ends, after the answer is retained).
		p, okP = bufs.rendered, true
	} else {
		p, okP = capture.AppendTokenIDs(nil, prompt)
	}
	g, okG := capture.AppendTokenIDs(nil, gen)
	return tokenIDs{prompt: p, generated: g, ok: okP && okG}
}

// errAnswerCharge fails a turn whose decode answer did not fit WithLimits'
// ChargeAnswer: 503 (HTTPStatus), not redone.
var errAnswerCharge = errors.New("kvroute: the decode answer does not fit the memory bound for answers held (WithLimits' ChargeAnswer); retry later")

// answerCharge is what a Response charged to WithLimits' ChargeAnswer for
// the answer it holds.
type answerCharge struct {
	fn  func(context.Context, int64) bool // nil: nothing is charged
	ctx context.Context
	n   int64 // charged, not given back
}

// take charges n more bytes, or reports that they do not fit.
func (c *answerCharge) take(n int64) bool {
	if c.fn == nil || n <= 0 {
		return true
	}
	if !c.fn(c.ctx, n) {
		return false
	}
	c.n += n
	return true
}

// giveBack gives back everything charged, once.
func (c *answerCharge) giveBack() {
	if c.n > 0 {
		n := c.n
		c.n = 0
		c.fn(c.ctx, -n)
	}
}

// chargedReader charges the bytes it reads beyond the first free (the
// answer's declared length, charged before) as they arrive.
type chargedReader struct {
	r    io.Reader
	c    *answerCharge
	free int64
}

func (cr *chargedReader) Read(p []byte) (int, error) {
	n, err := cr.r.Read(p)
	if over := int64(n) - cr.free; over > 0 {
		cr.free = 0
		if !cr.c.take(over) {
			return 0, errAnswerCharge
		}
	} else {
		cr.free -= int64(n)
	}
	return n, err
}
