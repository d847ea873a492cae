package streamsynth

import (
	"fmt"
	"io"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// completionChoice is one choice of a completion, raw; nil when absent.
type completionChoice struct {
	index, text, finish, stop, logprobs, promptIDs, tokenIDs []byte
}

// readCompletionChoice reads and validates a choice of a completion.
func readCompletionChoice(c []byte) (completionChoice, error) {
	var ch completionChoice
	if len(c) == 0 || c[0] != '{' {
		return ch, fmt.Errorf("%w: a choice is not an object", ErrMalformed)
	}
	_ = jsonraw.Members(c, func(key string, v []byte) error {
		switch key {
		case "index":
			ch.index = v
		case "text":
			ch.text = v
		case "finish_reason":
			ch.finish = v
		case "stop_reason":
			ch.stop = v
		case "logprobs":
			ch.logprobs = v
		case "prompt_token_ids":
			ch.promptIDs = v
		case "token_ids":
			ch.tokenIDs = v
		}
		return nil
	})
	var err error
	if ch.index, err = indexOf(ch.index); err != nil {
		return ch, err
	}
	if !isText(ch.text) || !isText(ch.finish) {
		return ch, fmt.Errorf("%w: a choice's text or finish_reason is not a string", ErrMalformed)
	}
	return ch, nil
}

// writeCompletions writes a completion as vLLM's chunk stream: per choice
// a chunk with the whole text, its logprobs and token ids (left out when
// all are empty), then a finish chunk with empty text, finish_reason and
// stop_reason; the usage chunk when asked; data: [DONE]. Every chunk has
// "object": "text_completion".
func writeCompletions(w io.Writer, obj jsonraw.Object, opt Options) error {
	h, err := readHead(obj, "text_completion")
	if err != nil {
		return err
	}
	arr, err := choicesOf(obj)
	if err != nil {
		return err
	}
	choices := make([]completionChoice, 0, 1)
	if err := jsonraw.Elements(arr, func(c []byte) error {
		ch, err := readCompletionChoice(c)
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
		extras := present(ch.logprobs) || present(ch.promptIDs) || present(ch.tokenIDs)
		if nonEmpty(ch.text) || extras {
			h.open(o)
			o.s(`{"index":`)
			choiceIndex(o, ch.index, i)
			o.s(`,"text":`)
			o.rawOr(ch.text, `""`)
			o.s(`,"logprobs":`)
			o.rawOr(ch.logprobs, "null")
			o.s(`,"finish_reason":null,"stop_reason":null`)
			if present(ch.promptIDs) {
				o.s(`,"prompt_token_ids":`)
				o.raw(ch.promptIDs)
			}
			if present(ch.tokenIDs) {
				o.s(`,"token_ids":`)
				o.raw(ch.tokenIDs)
			}
			o.s(`}`)
			h.close(o, opt, false, false, false)
		}
		h.open(o)
		o.s(`{"index":`)
		choiceIndex(o, ch.index, i)
		o.s(`,"text":"","logprobs":null,"finish_reason":`)
		finishReason(o, ch.finish)
		o.s(`,"stop_reason":`)
		o.rawOr(ch.stop, "null")
		o.s(`}`)
		h.close(o, opt, false, !h.usageChunk(opt), false)
	}
	h.end(o, opt)
	return o.flush()
}
