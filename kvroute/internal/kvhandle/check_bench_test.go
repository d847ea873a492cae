package kvhandle

import (
	"fmt"
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
// every handle it captures or attaches.
func BenchmarkCheck(b *testing.B) {
	for _, c := range benchHandles {
		h := toytok.Handle(7, c.tokens, defaultBlockSize)
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(h)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := Check(h, defaultBlockSize); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkCheckParts compares Check's one pass with its parts before:
// the parse of the handle, and the per-element walk of its block list.
func BenchmarkCheckParts(b *testing.B) {
	for _, c := range benchHandles {
		h := toytok.Handle(7, c.tokens, defaultBlockSize)
		obj, err := jsonraw.Parse(h)
		if err != nil {
			b.Fatal(err)
		}
		blocks, _ := obj.Get("remote_block_ids")
		b.Run(fmt.Sprintf("parse/%s", c.name), func(b *testing.B) {
			b.SetBytes(int64(len(h)))
			for b.Loop() {
				if _, err := jsonraw.Parse(h); err != nil {
					b.Fatal(err)
				}
			}
		})
		b.Run(fmt.Sprintf("elements/%s", c.name), func(b *testing.B) {
			b.SetBytes(int64(len(blocks)))
			for b.Loop() {
				if _, err := blockGroupsElements(blocks); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// BenchmarkForHit turns a retained real-size handle into message 2.
func BenchmarkForHit(b *testing.B) {
	for _, c := range benchHandles {
		h := toytok.Handle(7, c.tokens, defaultBlockSize)
		b.Run(c.name, func(b *testing.B) {
			b.SetBytes(int64(len(h)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := ForHit(h, defaultBlockSize); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
