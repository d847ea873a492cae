package sim

import (
	"hash/fnv"
	"strings"
)

// The simulated model. The KV value at position p is
//
//	kv[p] = mix(kv[p-1], token[p], p)      with kv[-1] = seed(model)
//
// computed from whatever the engine holds at p-1, so a block read from the
// wrong place poisons every later position. The next token is a function of
// the last KV value only, so an engine's answer depends on the KV it actually
// holds for the prompt, never on the prompt text directly.

// words is the fixed reply vocabulary (letters only, so replies re-tokenize
// to exactly the generated tokens).
var words = strings.Fields(`amber basil cedar delta ember fable garnet harbor
ivory jasper kernel lagoon meadow nectar orbit pebble quartz raven saffron
timber umber velvet willow xenon yonder zephyr anchor beacon canyon dune
falcon glacier hollow island jungle kite lantern marble nimbus oasis prairie
quill river summit tundra valley wander acorn breeze coral dawn`)

func splitmix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9
	x = (x ^ (x >> 27)) * 0x94d049bb133111eb
	return x ^ (x >> 31)
}

func mix(prev uint64, tok uint32, pos int) uint64 {
	return splitmix(prev ^ uint64(tok)<<17 ^ uint64(pos)*0x2545f4914f6cdd1d)
}

// Seed is kv[-1] for a model name.
func Seed(model string) uint64 {
	h := fnv.New64a()
	_, _ = h.Write([]byte(model))
	return splitmix(h.Sum64())
}

// chain returns kv values for toks computed from prev at positions from on.
func chain(prev uint64, toks []uint32, from int) []uint64 {
	out := make([]uint64, len(toks))
	for i, t := range toks {
		prev = mix(prev, t, from+i)
		out[i] = prev
	}
	return out
}

// GenParams bounds generation.
type GenParams struct {
	MaxTokens int // 0: no bound but the reply's own length
	MinTokens int
	IgnoreEOS bool
	Stop      []string
	Reasoning bool
	// Sample selects among n > 1 choices; 0 is the reference sample.
	Sample int
	// EOS is the end-of-turn token text ("" means <|im_end|>).
	EOS string
	// DriftRate is the probability (0 to 1, decided from the KV) that the
	// reply emits one content word as two tokens (" amber" as " am" +
	// "ber"): a non-canonical split whose text re-tokenizes to one token,
	// as BPE sampling can produce.
	DriftRate float64
	// Trailing lets the reply end, before EOS, with a whitespace token
	// (" " or "\n"), chosen from the KV, about one reply in three: what
	// makes a trimming template (Llama-3) matter.
	Trailing bool
	// Tools, ToolChoice and ToolCallRate make the reply a tool call
	// (toolcall.go): under ToolChoiceRequired always, under ToolChoiceAuto
	// with probability ToolCallRate (0 to 1, decided from the KV) where
	// the reply would end.
	Tools        []Tool
	ToolChoice   string
	ToolCallRate float64
}

// Generated is a decoded reply.
type Generated struct {
	Tokens []Token
	KV     []uint64 // KV of each generated token, at positions n, n+1, ...
	// From is the KV the first token was generated from (the prompt's
	// last, for choices after the first mixed with the sample): with KV
	// it decides each position's logprobs (logprobs.go).
	From      uint64
	Content   string
	Reasoning string
	Finish    string // "stop" or "length"
	// StopString is the stop string that ended the reply, if any.
	StopString string
	// Call is the tool call the reply generated (Content is then the text
	// before it), nil when none.
	Call *Call
}

// maxIgnoreEOS bounds replies with ignore_eos and no max_tokens.
const maxIgnoreEOS = 1024

// Generate decodes a reply after a prompt of n tokens whose last KV value is
// last. The plan (reasoning length, reply length) comes from last; each token
// from the KV of the token before it.
func Generate(last uint64, n int, p GenParams) Generated {
	if p.Sample > 0 {
		last = splitmix(last + uint64(p.Sample)*0x9e3779b97f4a7c15)
	}
	plan := splitmix(last ^ 0x5bd1e995)
	nWords := 4 + int(plan%13)
	nReason := 3 + int((plan>>8)%6)
	g := Generated{From: last}
	prev := last
	var content, reason strings.Builder
	wordsDone, reasonDone := 0, 0
	eos := p.EOS
	if eos == "" {
		eos = TokIMEnd
	}
	trailed := false
	driftAt := -1 // the content word emitted as two tokens
	if p.DriftRate > 0 && float64(splitmix(plan^0xd21f7)%1_000_000) < p.DriftRate*1_000_000 {
		driftAt = int((plan >> 16) % uint64(nWords))
	}
	var pending *Token // the second half of a split word
	var call *callGen  // the tool call being generated
	phase := 0         // 0 think open, 1 reasoning, 2 think close, 3 blank, 4 content
	if !p.Reasoning {
		phase = 4
	}
	emit := func(t Token) {
		prev = mix(prev, t.ID, n+len(g.Tokens))
		g.Tokens = append(g.Tokens, t)
		g.KV = append(g.KV, prev)
	}
	word := func(first bool) Token {
		w := words[splitmix(prev)%uint64(len(words))]
		if !first {
			w = " " + w
		}
		return Token{ID: pieceID(w), Text: w}
	}
	for {
		if p.MaxTokens > 0 && len(g.Tokens) >= p.MaxTokens {
			g.Finish = "length"
			break
		}
		if p.MaxTokens == 0 && len(g.Tokens) >= maxIgnoreEOS {
			g.Finish = "length"
			break
		}
		switch phase {
		case 0:
			emit(Token{ID: specialID(TokThinkOpen), Text: TokThinkOpen})
			phase = 1
		case 1:
			t := word(reasonDone == 0)
			emit(t)
			reason.WriteString(t.Text)
			reasonDone++
			if reasonDone == nReason {
				phase = 2
			}
		case 2:
			emit(Token{ID: specialID(TokThinkClose), Text: TokThinkClose})
			phase = 3
		case 3:
			emit(Token{ID: pieceID("\n\n"), Text: "\n\n"})
			phase = 4
		default:
			if pending != nil {
				t := *pending
				pending = nil
				emit(t)
				content.WriteString(t.Text)
				if s, cut, ok := findStop(content.String(), p.Stop); ok {
					g.Content, g.Reasoning, g.Finish, g.StopString = cut, reason.String(), "stop", s
					return g
				}
				continue
			}
			if call != nil {
				if t, ok := call.next(word); ok {
					emit(t)
					continue
				}
				g.Call = call.finish(len(g.Tokens))
				emit(Token{ID: specialID(eos), Text: ""})
				g.Finish = "stop"
				break
			}
			if len(p.Tools) > 0 && p.ToolChoice == ToolChoiceRequired {
				// guided decoding: the reply is the call, its words going
				// on while EOS is not allowed
				call = startCall(p.Tools, true, splitmix(prev^0xca11), "", len(g.Tokens), func(tail int) bool {
					return !p.IgnoreEOS && len(g.Tokens)+tail+1 > p.MinTokens
				})
				continue
			}
			if wordsDone >= nWords && !p.IgnoreEOS && len(g.Tokens)+1 > p.MinTokens {
				if autoCall(p, prev) {
					sep := ""
					if content.Len() > 0 {
						sep = "\n"
					}
					call = startCall(p.Tools, false, splitmix(prev^0xca11), sep, len(g.Tokens), func(int) bool { return true })
					continue
				}
				if p.Trailing && !trailed {
					trailed = true
					if h := splitmix(prev ^ 0x7a11); h%3 == 0 {
						ws := " "
						if (h>>8)&1 == 1 {
							ws = "\n"
						}
						emit(Token{ID: pieceID(ws), Text: ws})
						content.WriteString(ws)
						continue
					}
				}
				emit(Token{ID: specialID(eos), Text: ""})
				g.Finish = "stop"
				break
			}
			t := word(wordsDone == 0)
			if wordsDone == driftAt {
				k := len(t.Text) / 2
				if t.Text[0] == ' ' {
					k = 1 + (len(t.Text)-1)/2
				}
				second := Token{ID: pieceID(t.Text[k:]), Text: t.Text[k:]}
				t = Token{ID: pieceID(t.Text[:k]), Text: t.Text[:k]}
				pending = &second
			}
			emit(t)
			content.WriteString(t.Text)
			wordsDone++
			if s, cut, ok := findStop(content.String(), p.Stop); ok {
				g.Content, g.Reasoning, g.Finish, g.StopString = cut, reason.String(), "stop", s
				return g
			}
		}
		if g.Finish != "" {
			break
		}
	}
	g.Content, g.Reasoning = content.String(), reason.String()
	if call != nil && g.Call == nil {
		g.Call = call.finish(len(g.Tokens)) // cut by max_tokens
	}
	return g
}

// autoCall decides from the KV whether a reply under tool_choice auto
// ends in a tool call where it would end.
func autoCall(p GenParams, prev uint64) bool {
	return len(p.Tools) > 0 && p.ToolChoice == ToolChoiceAuto && p.ToolCallRate > 0 &&
		float64(splitmix(prev^0x7001)%1_000_000) < p.ToolCallRate*1_000_000
}

func findStop(text string, stops []string) (stop, cut string, ok bool) {
	best := -1
	for _, s := range stops {
		if s == "" {
			continue
		}
		if i := strings.Index(text, s); i >= 0 && (best < 0 || i < best) {
			best, stop = i, s
		}
	}
	if best < 0 {
		return "", "", false
	}
	return stop, text[:best], true
}

// Reference generates what a single engine holding the correct KV for prompt
// answers.
func Reference(model string, prompt []uint32, p GenParams) Generated {
	kv := chain(Seed(model), prompt, 0)
	return Generate(kv[len(kv)-1], len(prompt), p)
}

// sameTokens reports whether two generations produced the same tokens.
func sameTokens(a, b []Token) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i].ID != b[i].ID {
			return false
		}
	}
	return true
}
