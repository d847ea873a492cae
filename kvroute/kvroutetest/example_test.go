package kvroutetest_test

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"time"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// A hand-driven disaggregated turn: P prefills and hands its blocks to D,
// whose answer matches a single engine's.
func Example() {
	// In a test: c := kvroutetest.NewCluster(t, 1, 1), then c.Prefill[0] and c.Decode[0].
	reg := kvroutetest.NewRegistry()
	P, _ := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg))
	defer P.Close()
	D, _ := kvroutetest.StartEngine(kvroutetest.WithRegistry(reg))
	defer D.Close()

	body := `{"model":"sim-model","messages":[{"role":"user","content":"Say something."}]`
	miss := `,"max_tokens":1,"kv_transfer_params":{"do_remote_decode":true,"do_remote_prefill":false,` +
		`"remote_engine_id":null,"remote_block_ids":null,"remote_host":null,"remote_port":null}}`

	var p struct {
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	resp, _ := http.Post(P.URL()+"/v1/chat/completions", "application/json", bytes.NewBufferString(body+miss))
	_ = json.NewDecoder(resp.Body).Decode(&p)
	resp.Body.Close()

	var d struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
	}
	resp, _ = http.Post(D.URL()+"/v1/chat/completions", "application/json",
		bytes.NewBufferString(body+`,"kv_transfer_params":`+string(p.KV)+`}`))
	_ = json.NewDecoder(resp.Body).Decode(&d)
	resp.Body.Close()

	want, _ := kvroutetest.Reference("/v1/chat/completions", []byte(body+"}"))
	fmt.Println(d.Choices[0].Message.Content == want.Text)
	fmt.Println(D.Stats().TokensPulledIn == P.Stats().TokensPulledOut)
	fmt.Println(P.Stats().BlocksPinned, D.Stats().WrongOutputs)
	// Output:
	// true
	// true
	// 0 0
}

// Two requests on an engine whose KV cache holds only one of them, on an
// event clock: the second waits for the first to finish, in modelled time.
func ExampleEventClock() {
	clk := kvroutetest.NewEventClock(time.Unix(0, 0))
	prof := kvroutetest.Profile{PrefillPerToken: time.Millisecond, InterTokenLatency: 10 * time.Millisecond}
	e, _ := kvroutetest.StartEngine(kvroutetest.WithClock(clk), kvroutetest.WithProfile(prof),
		kvroutetest.WithNumBlocks(8)) // 128 tokens
	defer e.Close()

	ctx := context.Background()
	for i, id := range []string{"first", "second"} {
		clk.Join()
		go func() {
			defer clk.Leave()
			_ = clk.Sleep(ctx, time.Duration(i+1)*time.Millisecond) // arrives at 1 ms, 2 ms
			prompt := make([]int, 100)                              // 7 blocks
			for j := range prompt {
				prompt[j] = 1000 + 100*i + j
			}
			body, _ := json.Marshal(map[string]any{"model": "sim-model", "prompt": prompt, "max_tokens": 8, "ignore_eos": true})
			req, _ := http.NewRequestWithContext(ctx, http.MethodPost, e.URL()+"/v1/completions", bytes.NewReader(body))
			req.Header.Set("X-Request-Id", id)
			if resp, err := http.DefaultClient.Do(req); err == nil {
				resp.Body.Close()
			}
		}()
	}
	_ = clk.Run(ctx)
	for _, r := range e.Requests() {
		fmt.Println(r.RequestID, "queued", r.Queued, "first token after", r.FirstToken)
	}
	// Output:
	// first queued 0s first token after 100ms
	// second queued 179ms first token after 279ms
}
