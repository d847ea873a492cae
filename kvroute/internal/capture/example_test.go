package capture_test

import (
	"fmt"
	"io"
	"net/http/httptest"
	"strings"

	"github.com/bidikv/bidikv/kvroute/internal/capture"
	"github.com/bidikv/bidikv/sse"
)

// Example forwards a decode engine's stream to a client, removing the KV
// handle from the final chunk and keeping it for the next turn.
func Example() {
	upstream := strings.NewReader(
		`data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}` + "\n\n" +
			": keep-alive\n\n" +
			`data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}],"kv_transfer_params":{"remote_block_ids":[[7,8]],"remote_port":5600}}` + "\n\n" +
			"data: [DONE]\n\n")

	rec := httptest.NewRecorder()
	w := sse.NewWriter(rec)
	r := sse.NewReader(upstream)
	c := capture.NewChunks(capture.WithReply())
	for {
		e, err := r.Next()
		if err == io.EOF {
			break
		}
		if err != nil {
			panic(err)
		}
		out, err := c.Forward(e)
		if err != nil {
			panic(err)
		}
		if err := w.WriteRaw(out); err != nil {
			panic(err)
		}
	}
	fmt.Print(rec.Body.String())
	fmt.Println("handle:", string(c.Handle()))
	fmt.Println("finish:", c.Reply().FinishReason, "done:", c.Done(), "reply:", c.Reply().Content)
	// Output:
	// data: {"choices":[{"index":0,"delta":{"content":"Hi"},"finish_reason":null}]}
	//
	// : keep-alive
	//
	// data: {"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}
	//
	// data: [DONE]
	//
	// handle: {"remote_block_ids":[[7,8]],"remote_port":5600}
	// finish: stop done: true reply: Hi
}
