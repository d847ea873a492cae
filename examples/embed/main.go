// Command embed is the README's embedding example: a server of the four
// APIs agents speak (chat completions, completions, OpenAI's Responses and
// Anthropic's Messages) that routes every turn over vLLM prefill and decode
// engines with bidirectional KV reuse. TestReadmeEmbed (in the module root)
// keeps the README's snippet and this file the same.
//
//	go run ./examples/embed -prefill http://10.0.0.1:8100 -decode http://10.0.0.2:8200
package main

import (
	"flag"
	"log"
	"log/slog"
	"net/http"
	"os"

	"github.com/bidikv/bidikv/kvroute"
)

func main() {
	prefill := flag.String("prefill", "http://127.0.0.1:8100", "prefill engine URL")
	decode := flag.String("decode", "http://127.0.0.1:8200", "decode engine URL")
	addr := flag.String("addr", "127.0.0.1:8000", "listen address")
	flag.Parse()

	router, err := kvroute.New(
		kvroute.WithPrefill(*prefill),
		kvroute.WithDecode(*decode),
		kvroute.WithLogger(slog.New(slog.NewTextHandler(os.Stderr, nil))),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()
	mux := http.NewServeMux()
	mux.Handle("POST "+kvroute.PathChatCompletions, router)
	mux.Handle("POST "+kvroute.PathCompletions, router)
	mux.Handle("POST "+kvroute.PathResponses, router) // OpenAI's Responses API (Codex)
	mux.Handle("POST "+kvroute.PathMessages, router)  // Anthropic's Messages API (Claude Code)
	log.Fatal(http.ListenAndServe(*addr, mux))
}
