package kvroutetest_test

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"

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
