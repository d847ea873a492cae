package jsonraw_test

import (
	"strconv"
	"strings"
	"testing"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// chatBody returns an OpenAI chat request of about size bytes.
func chatBody(size int) []byte {
	var b strings.Builder
	b.WriteString(`{"model":"meta-llama/Llama-3.1-8B-Instruct","messages":[{"role":"system","content":"You are a helpful assistant."}`)
	para := `Lorem ipsum dolor sit amet, \"consectetur\" adipiscing elit.\nSed do eiusmod tempor — incididunt ut labore et dolore magna aliqua. \u00e9\u4e16 `
	for i := 0; b.Len() < size-200; i++ {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		b.WriteString(`,{"role":"` + role + `","content":"`)
		for j := 0; j < 12; j++ {
			b.WriteString(para)
		}
		b.WriteString(strconv.Itoa(i) + `"}`)
	}
	b.WriteString(`],"stream":true,"stream_options":{"include_usage":false},"max_tokens":512,"temperature":0.7,"conversation_id":"c-123"}`)
	return []byte(b.String())
}

func BenchmarkParse100KB(b *testing.B) {
	body := chatBody(100 << 10)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		if _, err := jsonraw.Parse(body); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkParseEdit100KB(b *testing.B) {
	body := chatBody(100 << 10)
	del := []string{"max_completion_tokens", "min_tokens", "min_completion_tokens", "stream_options", "conversation_id"}
	set := []jsonraw.Member{
		{Key: "stream", Value: []byte("false")},
		{Key: "max_tokens", Value: []byte("1")},
		{Key: "kv_transfer_params", Value: []byte(`{"do_remote_decode":true,"do_remote_prefill":false,"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}`)},
	}
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		o, err := jsonraw.Parse(body)
		if err != nil {
			b.Fatal(err)
		}
		_ = o.Edit(del, set...)
	}
}

func BenchmarkWalkMessages100KB(b *testing.B) {
	body := chatBody(100 << 10)
	o, err := jsonraw.Parse(body)
	if err != nil {
		b.Fatal(err)
	}
	msgs, _ := o.Get("messages")
	var buf []byte
	b.SetBytes(int64(len(msgs)))
	b.ReportAllocs()
	for b.Loop() {
		err := jsonraw.Elements(msgs, func(m []byte) error {
			return jsonraw.Members(m, func(k string, v []byte) error {
				if k == "content" {
					buf, _ = jsonraw.AppendString(buf[:0], v)
				}
				return nil
			})
		})
		if err != nil {
			b.Fatal(err)
		}
	}
}

// historyBody is a chat request as bench --overhead sends it: a short
// system prompt and one user message of about size bytes of code-like
// words, a line break (an escape) every 16 words.
func historyBody(size int) []byte {
	var b strings.Builder
	words := []string{" func", " return", " err", " nil", " struct", " handle", " decode", " prefill", " stream", " token"}
	for i := 0; b.Len() < size; i++ {
		if i%16 == 15 {
			b.WriteString(`\n`)
		}
		b.WriteString(words[i%len(words)])
	}
	return []byte(`{"model":"sim-model","messages":[{"role":"system","content":"You are a coding agent."},{"role":"user","content":"` +
		b.String() + `"}],"max_tokens":8,"stream":true}`)
}

// BenchmarkParseHistory validates and indexes a request whose history
// is one long message (the router's parse of every request).
func BenchmarkParseHistory(b *testing.B) {
	for _, size := range []int{100 << 10, 400 << 10} {
		b.Run(strconv.Itoa(size>>10)+"KB", func(b *testing.B) {
			body := historyBody(size)
			b.SetBytes(int64(len(body)))
			b.ReportAllocs()
			for b.Loop() {
				if _, err := jsonraw.Parse(body); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}
