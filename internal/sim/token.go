package sim

import (
	"fmt"
	"hash/fnv"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Special tokens. Each is one token wherever it appears in text.
const (
	TokIMStart    = "<|im_start|>"
	TokIMEnd      = "<|im_end|>"
	TokEndOfText  = "<|endoftext|>"
	TokThinkOpen  = "<think>"
	TokThinkClose = "</think>"
)

var specials = []struct {
	text string
	id   uint32
}{
	{TokEndOfText, 151643},
	{TokIMStart, 151644},
	{TokIMEnd, 151645},
	{TokThinkOpen, 151667},
	{TokThinkClose, 151668},
	{TokBeginOfText, 128000},
	{TokStartHeader, 128006},
	{TokEndHeader, 128007},
	{TokEOT, 128009},
}

// specialID returns the id of a special token text.
func specialID(s string) uint32 {
	for _, sp := range specials {
		if sp.text == s {
			return sp.id
		}
	}
	return pieceID(s)
}

// Token is one token: its id and the text it decodes to.
type Token struct {
	ID   uint32
	Text string
}

// pieceID is the id of an ordinary text piece: FNV-1a of its bytes, kept
// clear of the special-token range.
func pieceID(s string) uint32 {
	h := fnv.New32a()
	_, _ = h.Write([]byte(s))
	return h.Sum32() | 1<<31
}

// Tokenize splits text into tokens. The rules, applied left to right:
// a special token is one token; a run of newlines is one token; a letter or
// digit run, with at most one directly preceding space, is one token; other
// spaces and tabs form one token (leaving the last space to a following word);
// any other rune is one token. Tokenize(a+b) == Tokenize(a)+Tokenize(b)
// whenever b starts with a special token, which is what keeps rendered chat
// turns prefix-stable.
func Tokenize(text string) []Token {
	var out []Token
	i := 0
	for i < len(text) {
		if sp, ok := specialAt(text[i:]); ok {
			out = append(out, Token{ID: specialID(sp), Text: sp})
			i += len(sp)
			continue
		}
		n := pieceLen(text[i:])
		p := text[i : i+n]
		out = append(out, Token{ID: pieceID(p), Text: p})
		i += n
	}
	return out
}

func specialAt(s string) (string, bool) {
	if !strings.HasPrefix(s, "<") {
		return "", false
	}
	for _, sp := range specials {
		if strings.HasPrefix(s, sp.text) {
			return sp.text, true
		}
	}
	return "", false
}

func isWordRune(r rune) bool { return unicode.IsLetter(r) || unicode.IsDigit(r) }

// pieceLen returns the byte length of the ordinary piece starting s.
func pieceLen(s string) int {
	r, size := utf8.DecodeRuneInString(s)
	switch {
	case r == '\n':
		n := 0
		for n < len(s) && s[n] == '\n' {
			n++
		}
		return n
	case isWordRune(r):
		return size + wordRun(s[size:])
	case r == ' ' || r == '\t':
		if r == ' ' {
			if r2, _ := utf8.DecodeRuneInString(s[size:]); isWordRune(r2) {
				return size + wordRun(s[size:])
			}
		}
		n := 0
		for n < len(s) && (s[n] == ' ' || s[n] == '\t') {
			// leave a final space to the word that follows it
			if s[n] == ' ' && n > 0 {
				if r2, _ := utf8.DecodeRuneInString(s[n+1:]); isWordRune(r2) {
					break
				}
			}
			n++
		}
		return n
	default:
		return size
	}
}

func wordRun(s string) int {
	n := 0
	for n < len(s) {
		if _, ok := specialAt(s[n:]); ok {
			return n
		}
		r, size := utf8.DecodeRuneInString(s[n:])
		if !isWordRune(r) {
			return n
		}
		n += size
	}
	return n
}

// tokenOfID is the token of a raw id given in a prompt: a special token
// decodes to its text, any other id to "<id>".
func tokenOfID(id uint32) Token {
	for _, sp := range specials {
		if sp.id == id {
			return Token{ID: id, Text: sp.text}
		}
	}
	return Token{ID: id, Text: fmt.Sprintf("<%d>", id)}
}

// ids returns the ids of toks.
func ids(toks []Token) []uint32 {
	out := make([]uint32, len(toks))
	for i, t := range toks {
		out[i] = t.ID
	}
	return out
}
