package streamsynth

import (
	"fmt"
	"io"
	"strconv"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// chatChoice is one choice of a chat completion, raw values of the body;
// nil when absent.
type chatChoice struct {
	index, finish, stop, logprobs, tokenIDs    []byte
	role, content, reasoning, reasoningContent []byte
	toolCalls                                  []byte
}

// readChatChoice reads and validates a choice of a chat completion.
func readChatChoice(c []byte) (chatChoice, error) {
	var ch chatChoice
	if len(c) == 0 || c[0] != '{' {
		return ch, fmt.Errorf("%w: a choice is not an object", ErrMalformed)
	}
	var message []byte
	_ = jsonraw.Members(c, func(key string, v []byte) error {
		switch key {
		case "index":
			ch.index = v
		case "message":
			message = v
		case "finish_reason":
			ch.finish = v
		case "stop_reason":
			ch.stop = v
		case "logprobs":
			ch.logprobs = v
		case "token_ids":
			ch.tokenIDs = v
		}
		return nil
	})
	var err error
	if ch.index, err = indexOf(ch.index); err != nil {
		return ch, err
	}
	if !isText(ch.finish) {
		return ch, fmt.Errorf("%w: finish_reason is not a string", ErrMalformed)
	}
	if present(message) {
		if message[0] != '{' {
			return ch, fmt.Errorf("%w: message is not an object", ErrMalformed)
		}
		_ = jsonraw.Members(message, func(key string, v []byte) error {
			switch key {
			case "role":
				ch.role = v
			case "content":
				ch.content = v
			case "reasoning":
				ch.reasoning = v
			case "reasoning_content":
				ch.reasoningContent = v
			case "tool_calls":
				ch.toolCalls = v
			}
			return nil
		})
	}
	if !isText(ch.role) || !isText(ch.content) || !isText(ch.reasoning) || !isText(ch.reasoningContent) {
		return ch, fmt.Errorf("%w: a message's role, content or reasoning is not a string", ErrMalformed)
	}
	if present(ch.toolCalls) {
		if ch.toolCalls[0] != '[' {
			return ch, fmt.Errorf("%w: tool_calls is not an array", ErrMalformed)
		}
		if err := jsonraw.Elements(ch.toolCalls, func(tc []byte) error {
			_, err := readToolCall(tc)
			return err
		}); err != nil {
			return ch, err
		}
	}
	return ch, nil
}

// toolCall is one element of a message's tool_calls, raw.
type toolCall struct {
	id, typ, name, arguments []byte
}

// readToolCall reads and validates a tool call: an object whose function
// is an object with a string name; id, type and arguments strings when
// present.
func readToolCall(tc []byte) (toolCall, error) {
	var t toolCall
	if len(tc) == 0 || tc[0] != '{' {
		return t, fmt.Errorf("%w: a tool call is not an object", ErrMalformed)
	}
	var fn []byte
	_ = jsonraw.Members(tc, func(key string, v []byte) error {
		switch key {
		case "id":
			t.id = v
		case "type":
			t.typ = v
		case "function":
			fn = v
		}
		return nil
	})
	if len(fn) == 0 || fn[0] != '{' {
		return t, fmt.Errorf("%w: a tool call's function is not an object", ErrMalformed)
	}
	_ = jsonraw.Members(fn, func(key string, v []byte) error {
		switch key {
		case "name":
			t.name = v
		case "arguments":
			t.arguments = v
		}
		return nil
	})
	if t.name == nil || t.name[0] != '"' || !isText(t.id) || !isText(t.typ) || !isText(t.arguments) {
		return t, fmt.Errorf("%w: a tool call's name, id, type or arguments is not a string", ErrMalformed)
	}
	return t, nil
}

// writeChat writes a chat completion as vLLM's chunk stream: for each
// choice a first chunk with the role and empty content (and the prompt's
// token ids when the answer has them); then per choice the reasoning (in
// the member, or both members, the answer uses: reasoning,
// reasoning_content), the content, and each tool call (a chunk with its
// index, id, type and name with empty arguments, then one with the
// arguments), each in one chunk; the logprobs and token ids ride whole on
// the first of these; a finish chunk with an empty delta, finish_reason and
// stop_reason; the usage chunk when asked; data: [DONE].
func writeChat(w io.Writer, obj jsonraw.Object, opt Options) error {
	h, err := readHead(obj, "chat.completion.chunk")
	if err != nil {
		return err
	}
	arr, err := choicesOf(obj)
	if err != nil {
		return err
	}
	choices := make([]chatChoice, 0, 1)
	if err := jsonraw.Elements(arr, func(c []byte) error {
		ch, err := readChatChoice(c)
		if err == nil {
			err = uniqueIndex(ch.index, len(choices), func(i int) []byte { return choices[i].index })
		}
		choices = append(choices, ch)
		return err
	}); err != nil {
		return err
	}
	o := newOut(w)
	for i := range choices {
		ch := &choices[i]
		h.open(o)
		o.s(`{"index":`)
		choiceIndex(o, ch.index, i)
		o.s(`,"delta":{"role":`)
		o.rawOr(ch.role, `"assistant"`)
		o.s(`,"content":""},"logprobs":null,"finish_reason":null}`)
		h.close(o, opt, true, false, true)
	}
	for i := range choices {
		writeChatChoice(o, &h, opt, &choices[i], i)
	}
	h.end(o, opt)
	return o.flush()
}

// writeChatChoice writes a choice's delta chunks and its finish chunk.
func writeChatChoice(o out, h *head, opt Options, ch *chatChoice, pos int) {
	d := &choiceDeltas{o: o, h: h, opt: opt, ch: ch, pos: pos, extras: true}
	if nonEmpty(ch.reasoning) || nonEmpty(ch.reasoningContent) {
		d.send(func() {
			sep := ""
			if nonEmpty(ch.reasoning) {
				o.s(`"reasoning":`)
				o.raw(ch.reasoning)
				sep = ","
			}
			if nonEmpty(ch.reasoningContent) {
				o.s(sep)
				o.s(`"reasoning_content":`)
				o.raw(ch.reasoningContent)
			}
		})
	}
	if nonEmpty(ch.content) {
		d.send(func() {
			o.s(`"content":`)
			o.raw(ch.content)
		})
	}
	if present(ch.toolCalls) {
		d.toolCalls()
	}
	d.finish()
}

// choiceDeltas writes the chunks of one chat choice after its role chunk.
type choiceDeltas struct {
	o      out
	h      *head
	opt    Options
	ch     *chatChoice
	pos    int
	extras bool // logprobs and token ids still to send
}

// send writes one delta chunk whose delta members write writes.
func (d *choiceDeltas) send(write func()) {
	o, ch := d.o, d.ch
	d.h.open(o)
	o.s(`{"index":`)
	choiceIndex(o, ch.index, d.pos)
	o.s(`,"delta":{`)
	write()
	o.s(`},"logprobs":`)
	d.logprobs()
	o.s(`,"finish_reason":null`)
	d.tokenIDs()
	o.s(`}`)
	d.extras = false
	d.h.close(o, d.opt, false, false, false)
}

// logprobs writes the choice's logprobs on its first chunk, null after.
func (d *choiceDeltas) logprobs() {
	if d.extras {
		d.o.rawOr(d.ch.logprobs, "null")
	} else {
		d.o.s("null")
	}
}

// tokenIDs writes the choice's token ids on its first chunk.
func (d *choiceDeltas) tokenIDs() {
	if d.extras && present(d.ch.tokenIDs) {
		d.o.s(`,"token_ids":`)
		d.o.raw(d.ch.tokenIDs)
	}
}

// toolCalls writes each tool call as two chunks: its index, id, type and
// name with empty arguments, then its arguments.
func (d *choiceDeltas) toolCalls() {
	o, k := d.o, 0
	_ = jsonraw.Elements(d.ch.toolCalls, func(v []byte) error {
		tc, _ := readToolCall(v)
		d.send(func() {
			o.s(`"tool_calls":[{"index":`)
			_, _ = o.w.Write(appendInt(o, k))
			if present(tc.id) {
				o.s(`,"id":`)
				o.raw(tc.id)
			}
			o.s(`,"type":`)
			o.rawOr(tc.typ, `"function"`)
			o.s(`,"function":{"name":`)
			o.raw(tc.name)
			o.s(`,"arguments":""}}]`)
		})
		if nonEmpty(tc.arguments) {
			d.send(func() {
				o.s(`"tool_calls":[{"index":`)
				_, _ = o.w.Write(appendInt(o, k))
				o.s(`,"function":{"arguments":`)
				o.raw(tc.arguments)
				o.s(`}}]`)
			})
		}
		k++
		return nil
	})
}

// finish writes the choice's finish chunk.
func (d *choiceDeltas) finish() {
	o, ch := d.o, d.ch
	d.h.open(o)
	o.s(`{"index":`)
	choiceIndex(o, ch.index, d.pos)
	o.s(`,"delta":{},"logprobs":`)
	d.logprobs()
	o.s(`,"finish_reason":`)
	finishReason(o, ch.finish)
	if ch.stop != nil {
		o.s(`,"stop_reason":`)
		o.raw(ch.stop)
	}
	d.tokenIDs()
	o.s(`}`)
	d.h.close(o, d.opt, false, !d.h.usageChunk(d.opt), false)
}

// nonEmpty reports whether v is a string other than "".
func nonEmpty(v []byte) bool { return len(v) > 2 && v[0] == '"' }

// appendInt formats n in o's free buffer space.
func appendInt(o out, n int) []byte { return strconv.AppendInt(o.w.AvailableBuffer(), int64(n), 10) }
