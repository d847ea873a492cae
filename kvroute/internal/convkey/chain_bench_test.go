package convkey

import (
	"encoding/json"
	"fmt"
	"strings"
	"testing"
)

// conversation is a chat history as the overhead benchmark sends it: a
// short system prompt and one user message of about size bytes, a line
// break (an escape in JSON) every 16 words.
func conversation(size int) [][]byte {
	var b strings.Builder
	words := []string{" func", " return", " err", " nil", " struct", " handle", " decode", " prefill", " stream", " token"}
	for i := 0; b.Len() < size; i++ {
		if i%16 == 15 {
			b.WriteString("\n")
		}
		b.WriteString(words[i%len(words)])
	}
	var out [][]byte
	for _, m := range []map[string]string{
		{"role": "system", "content": "You are a coding agent."},
		{"role": "user", "content": b.String()},
	} {
		j, _ := json.Marshal(m)
		out = append(out, j)
	}
	return out
}

// BenchmarkChain hashes a conversation as a chat lookup does: every
// message chained, and the anchor (the start, up to the first user
// message) in the same pass.
func BenchmarkChain(b *testing.B) {
	for _, size := range []int{100 << 10, 400 << 10} {
		b.Run(fmt.Sprintf("%dKB", size>>10), func(b *testing.B) {
			msgs := conversation(size)
			c := NewChainer()
			b.SetBytes(int64(size))
			b.ReportAllocs()
			for b.Loop() {
				var cur, start [32]byte
				for _, m := range msgs {
					var err error
					if cur, _, err = c.Message(cur, m, &start); err != nil {
						b.Fatal(err)
					}
				}
			}
		})
	}
}
