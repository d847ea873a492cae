package kvhandle

import (
	"strconv"
	"strings"
	"testing"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/internal/toytok"
)

// benchHandles are D handles as vLLM emits them at 25k and 100k tokens:
// one block id per 16-token block (1,563 and 6,250 ids).
var benchHandles = []struct {
	name   string
	tokens int
}{{"25k", 25000}, {"100k", 100000}}

// BenchmarkCheck checks a real-size D handle, as the router does for
// every handle it captures or attaches: onepass is Check, elements the
// former per-element check (checkElements).
//
//	go test -run '^$' -bench 'Check|ForHit' -count 10 ./kvroute/internal/kvhandle
func BenchmarkCheck(b *testing.B) {
	for _, impl := range []struct {
		name  string
		check func([]byte, int) (Info, error)
	}{{"onepass", Check}, {"elements", checkElements}} {
		for _, c := range benchHandles {
			h := toytok.Handle(7, c.tokens, defaultBlockSize)
			b.Run(impl.name+"/"+c.name, func(b *testing.B) {
				b.SetBytes(int64(len(h)))
				b.ReportAllocs()
				for b.Loop() {
					if _, err := impl.check(h, defaultBlockSize); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkForHit turns a retained real-size handle into message 2:
// onepass is ForHit, elements the former way (checkElements, then a
// second parse to edit).
func BenchmarkForHit(b *testing.B) {
	former := func(h []byte) ([]byte, error) {
		if _, err := checkElements(h, defaultBlockSize); err != nil {
			return nil, err
		}
		obj, err := jsonraw.Parse(h)
		if err != nil {
			return nil, err
		}
		return obj.Edit(nil, jsonraw.Member{Key: "do_remote_decode", Value: jsonTrue}, jsonraw.Member{Key: "do_remote_prefill", Value: jsonFalse}), nil
	}
	for _, impl := range []struct {
		name string
		hit  func([]byte) ([]byte, error)
	}{{"onepass", func(h []byte) ([]byte, error) { return ForHit(h, defaultBlockSize) }}, {"elements", former}} {
		for _, c := range benchHandles {
			h := toytok.Handle(7, c.tokens, defaultBlockSize)
			b.Run(impl.name+"/"+c.name, func(b *testing.B) {
				b.SetBytes(int64(len(h)))
				b.ReportAllocs()
				for b.Loop() {
					if _, err := impl.hit(h); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// BenchmarkCheckKnown checks a real-size D handle whose block list the
// router read or wrote before (the answer's parse, the store entry's
// expansion): the rest of the handle is checked, the list not read again.
func BenchmarkCheckKnown(b *testing.B) {
	for _, c := range benchHandles {
		h := toytok.Handle(7, c.tokens, defaultBlockSize)
		hi, err := Check(h, defaultBlockSize)
		if err != nil {
			b.Fatal(err)
		}
		b.Run(c.name, func(b *testing.B) {
			b.ReportAllocs()
			for b.Loop() {
				if _, err := CheckKnown(h, defaultBlockSize, hi.Blocks); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkAnswerParse parses an engine's answer carrying a real-size D
// handle: plain is the validating parse alone (jsonraw.Object.Reset, which
// any router must do to read the answer), validated is what the router
// does, the parse that also reads the block list's shape (ResetAnswer)
// followed by the handle's checks (CheckKnown). validated - plain is what
// validating the handle costs on top of parsing the answer.
//
//	go test -run '^$' -bench AnswerParse -count 10 ./kvroute/internal/kvhandle
func BenchmarkAnswerParse(b *testing.B) {
	for _, c := range benchHandles {
		h := toytok.Handle(7, c.tokens, defaultBlockSize)
		body := []byte(`{"id":"cmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,` +
			`"message":{"role":"assistant","content":"` + strings.Repeat("word ", 400) + `"},"finish_reason":"stop"}],` +
			`"usage":{"prompt_tokens":` + strconv.Itoa(c.tokens) + `,"completion_tokens":400,"total_tokens":` + strconv.Itoa(c.tokens+400) + `},` +
			`"kv_transfer_params":` + string(h) + `}`)
		b.Run("plain/"+c.name, func(b *testing.B) {
			var obj jsonraw.Object
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				if err := obj.Reset(body); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run("validated/"+c.name, func(b *testing.B) {
			var obj jsonraw.Object
			b.SetBytes(int64(len(body)))
			for b.Loop() {
				known, err := ResetAnswer(&obj, body)
				if err != nil || known.End == 0 {
					b.Fatal(err, known)
				}
				v, _ := obj.Get(Key)
				if _, err := CheckKnown(v, defaultBlockSize, known); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
