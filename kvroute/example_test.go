package kvroute_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log"
	"net/http"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// Example runs two turns of a conversation through a Router over one
// simulated prefill engine and one simulated decode engine. The second
// turn's prefill pulls the KV the decode engine kept from the first.
func Example() {
	reg := kvroutetest.NewRegistry()
	// Prefix caching off on the prefill engine, as in vLLM's published
	// experiment: whatever P does not pull, it recomputes.
	p, err := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg), kvroutetest.WithPrefixCaching(false))
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close()
	d, err := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg))
	if err != nil {
		log.Fatal(err)
	}
	defer d.Close()

	router, err := kvroute.New(kvroute.WithPrefill(p.URL()), kvroute.WithDecode(d.URL()))
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	messages := []map[string]string{
		{"role": "system", "content": agentPrompt},
		{"role": "user", "content": "The test TestParse fails with an index out of range."},
	}
	for turn := 1; turn <= 2; turn++ {
		reply, reuse, same := ask(router, messages, 16)
		fmt.Printf("turn %d: %s, answer identical to a single engine: %t\n", turn, reuse, same)
		messages = append(messages,
			map[string]string{"role": "assistant", "content": reply},
			map[string]string{"role": "user", "content": "Now run the whole suite."})
	}
	fmt.Printf("prefill engine: %d tokens computed, %d pulled from the decode engine\n", p.Stats().TokensComputed, p.Stats().TokensPulledIn)
	// Output:
	// turn 1: miss, answer identical to a single engine: true
	// turn 2: hit, answer identical to a single engine: true
	// prefill engine: 79 tokens computed, 68 pulled from the decode engine
}

// ExampleWithVerification shows token verification with a reasoning
// model: the chat template drops the reply's <think> block from the next
// turn's history, so only the prefix whose tokens still match D's blocks
// is attached, and the answer is still the single engine's.
func ExampleWithVerification() {
	reg := kvroutetest.NewRegistry()
	p, err := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg), kvroutetest.WithPrefixCaching(false), kvroutetest.WithReasoning(true))
	if err != nil {
		log.Fatal(err)
	}
	defer p.Close()
	d, err := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg), kvroutetest.WithReasoning(true))
	if err != nil {
		log.Fatal(err)
	}
	defer d.Close()

	var last kvroute.TurnRecord
	router, err := kvroute.New(kvroute.WithPrefill(p.URL()), kvroute.WithDecode(d.URL()),
		kvroute.WithVerification(kvroute.Verification{Mode: kvroute.VerifyTokens}), // the default
		kvroute.WithObserver(kvroute.ObserverFunc(func(rec *kvroute.TurnRecord) { last = *rec })))
	if err != nil {
		log.Fatal(err)
	}
	defer router.Close()

	messages := []map[string]string{
		{"role": "system", "content": "You are a careful coding agent. Read the failing test, find the cause, fix it with the smallest change, run the tests again and report what you changed and why in one short paragraph. Think before you act: list the files, read the ones that matter, and never guess a name."},
		{"role": "user", "content": "The test TestParse fails with an index out of range."},
	}
	for turn := 1; turn <= 2; turn++ {
		reply, _, same := ask(router, messages, 32, kvroutetest.WithReasoning(true))
		fmt.Printf("turn %d: %s, answer identical to a single engine: %t\n", turn, last.Reuse, same)
		if last.Reuse == kvroute.ReuseHit {
			fmt.Printf("  handle held %d tokens; %d verified by %s; attached %d (partial: %t)\n",
				last.HandleTokens, last.VerifiedTokens, last.TokenSource, last.ReusableTokens, last.Partial)
		}
		messages = append(messages,
			map[string]string{"role": "assistant", "content": reply},
			map[string]string{"role": "user", "content": "Now run the whole suite."})
	}
	// Output:
	// turn 1: miss, answer identical to a single engine: true
	// turn 2: hit, answer identical to a single engine: true
	//   handle held 103 tokens; 80 verified by render; attached 80 (partial: true)
}

// agentPrompt is the system prompt of the examples' conversations: long
// enough for their KV to be worth a pull.
const agentPrompt = "You are a careful coding agent. Read the failing test, find the cause, fix it with the smallest change, run the tests again and report what you changed and why in one short paragraph."

// startEngines starts a simulated prefill engine and n decode engines that
// share a registry, as the engines of one deployment reach each other;
// stop closes them.
func startEngines(n int) (p *kvroutetest.Engine, d []*kvroutetest.Engine, stop func()) {
	reg := kvroutetest.NewRegistry()
	all := make([]*kvroutetest.Engine, 0, n+1)
	stop = func() {
		for _, e := range all {
			e.Close()
		}
	}
	for range n + 1 {
		e, err := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg))
		if err != nil {
			stop()
			log.Fatal(err)
		}
		all = append(all, e)
	}
	return all[0], all[1:], stop
}

// ask runs one chat turn through the router and reports the reply, the
// reuse outcome and whether the reply is the single engine's (ref are the
// engine options that shape it).
func ask(router *kvroute.Router, messages []map[string]string, maxTokens int, ref ...kvroutetest.Option) (reply, reuse string, same bool) {
	body, _ := json.Marshal(map[string]any{"model": kvroutetest.DefaultModel, "messages": messages, "max_tokens": maxTokens})
	resp, err := router.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Body: body})
	if err != nil {
		log.Fatal(err)
	}
	defer resp.Close()
	var out struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(resp.Body, &out); err != nil {
		log.Fatal(err)
	}
	want, _ := kvroutetest.Reference(kvroute.PathChatCompletions, body, ref...)
	reply = out.Choices[0].Message.Content
	return reply, resp.Header.Get("X-Bidikv-Reuse"), reply == want.Text
}

// ErrorBody answers in the error shape of each API: what a program in
// front of the Router (authentication, limits) writes to its clients.
func ExampleErrorBody() {
	err := errors.New("too many requests in flight")
	fmt.Println(string(kvroute.ErrorBody(kvroute.PathChatCompletions, http.StatusServiceUnavailable, err)))
	fmt.Println(string(kvroute.ErrorBody(kvroute.PathMessages, http.StatusServiceUnavailable, err)))
	fmt.Println(string(kvroute.ErrorBody(kvroute.PathMessages+"/count_tokens", http.StatusUnauthorized, errors.New("bad key"))))
	// Output:
	// {"error":{"message":"too many requests in flight","type":"server_error","param":null,"code":"upstream_unavailable"}}
	// {"type":"error","error":{"type":"overloaded_error","message":"too many requests in flight"}}
	// {"type":"error","error":{"type":"authentication_error","message":"bad key"}}
}
