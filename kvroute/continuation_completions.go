package kvroute

import (
	"encoding/binary"
	"unicode"
	"unicode/utf8"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// ContinuationKeys on completions: a prompt string is keyed on its anchor
// and checked with the text it must begin with; the seams between prompt,
// reply and what follows must be clean token boundaries (see
// ContinuationKeys).

func (c ContinuationKeys) completionLookup(req *Request) (Candidates, error) {
	text, ok := anchorText(req)
	if !ok {
		return Candidates{}, nil
	}
	return Candidates{Keys: completionAnchors(req, text)}, nil
}

const minAnchor = 16

func (c ContinuationKeys) completionKey(req *Request, reply *Reply, soft Refusal) (Retention, error) {
	prompt, ok := promptString(req)
	if !ok {
		// A prompt of token ids: keyed for token verification only.
		text, ok := anchorText(req)
		if key := completionAnchor(req, text); ok && key != "" {
			return Retention{Key: key, Refusal: RefuseUnkeyable}, nil
		}
		return Retention{Refusal: RefuseUnkeyable}, nil
	}
	// D tokenized the prompt alone: it must end where the next prompt's
	// tokenization will also cut, and so must the reply (checked by
	// Verify against what follows it).
	// A bad seam is a soft refusal: the key is still returned.
	var refusal Refusal
	if endsInSpace(prompt) || (reply.Content != "" && !cleanSeam(prompt, reply.Content)) {
		refusal = RefuseTokenBoundary
	}
	text := prompt + reply.Content
	if endsInSpace(text) {
		refusal = RefuseTokenBoundary
	}
	key := completionAnchor(req, text)
	if key == "" {
		return Retention{Refusal: RefuseUnkeyable}, nil
	}
	if soft != "" {
		refusal = soft
	}
	sum := completionCheckSum(req, text)
	check := binary.AppendUvarint(nil, uint64(len(text)))
	return Retention{Key: key, Check: append(check, sum[:]...), Refusal: refusal}, nil
}

// completionCheckSum is the content check of a completions turn whose
// prompt (plus reply) is text: a digest of the prompt-shaping fields
// (completionShaping: add_special_tokens puts a BOS token in front of the
// prompt, so the same text renders other tokens) and of text.
func completionCheckSum(req *Request, text string) [32]byte {
	shaping := shapingDigest(req, "completion", completionShaping)
	h := req.keys.Hasher()
	h.WriteDigest(shaping)
	h.FieldString("text", text)
	return req.keys.SumPut(h)
}

// promptString returns a completions prompt given as one string.
func promptString(req *Request) (string, bool) {
	v, ok := req.Field("prompt")
	if !ok {
		return "", false
	}
	if _, has := req.Field("suffix"); has {
		return "", false
	}
	return jsonraw.String(v)
}

// cleanSeam reports whether a BPE tokenizer is taken to split left+right
// between left and right (the heuristic of ContinuationKeys' doc): left
// ends in a rune that is not whitespace, and right begins with a space, or
// with a newline after a letter or digit. Punctuation takes the newlines
// after it ("." + "\n" is one Llama 3 token), one punctuation mark or a
// space prefixes the word after it, and letter and digit runs merge, so
// every other seam is refused.
func cleanSeam(left, right string) bool {
	a, _ := utf8.DecodeLastRuneInString(left)
	b, _ := utf8.DecodeRuneInString(right)
	if left == "" || right == "" || a == utf8.RuneError || unicode.IsSpace(a) {
		return false
	}
	switch b {
	case ' ':
		return true
	case '\n', '\r':
		return isWordRune(a)
	}
	return false
}

func isWordRune(r rune) bool { return unicode.IsLetter(r) || unicode.IsNumber(r) }

// endsInSpace reports whether s ends in a whitespace rune.
func endsInSpace(s string) bool {
	r, _ := utf8.DecodeLastRuneInString(s)
	return s != "" && unicode.IsSpace(r)
}
