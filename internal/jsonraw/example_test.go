package jsonraw_test

import (
	"fmt"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

func Example() {
	body := []byte(`{"model":"m", "stream":true, "kv\u005ftransfer_params":{"x":1}, "max_tokens":1.0e3}`)
	o, err := jsonraw.Parse(body)
	if err != nil {
		panic(err)
	}
	stream, _ := o.Get("stream")
	b, _ := jsonraw.Bool(stream)
	fmt.Println("stream:", b, "has handle:", o.Has("kv_transfer_params"))

	out := o.Edit([]string{"kv_transfer_params"}, jsonraw.Member{Key: "stream", Value: []byte("false")})
	fmt.Println(string(out))
	// Output:
	// stream: true has handle: true
	// {"model":"m", "stream":false, "max_tokens":1.0e3}
}
