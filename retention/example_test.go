package retention_test

import (
	"context"
	"fmt"
	"time"

	"github.com/bidikv/bidikv/retention"
)

func Example() {
	ctx := context.Background()
	m := retention.NewMemory(retention.WithMaxEntries(10_000))
	defer m.Close()

	handle := []byte(`{"remote_engine_id":"d-0","remote_block_ids":[[7,8,9]],"remote_num_tokens":412}`)
	if err := m.Put(ctx, "conversation-42", handle, 450*time.Second); err != nil {
		fmt.Println(err)
		return
	}

	v, ok, err := m.Take(ctx, "conversation-42")
	fmt.Println(string(v), ok, err)

	// A handle is single-use: the second Take misses.
	_, ok, err = m.Take(ctx, "conversation-42")
	fmt.Println(ok, err)

	err = m.Put(ctx, "conversation-43", handle, 0)
	fmt.Println(err)
	// Output:
	// {"remote_engine_id":"d-0","remote_block_ids":[[7,8,9]],"remote_num_tokens":412} true <nil>
	// false <nil>
	// retention: ttl must be positive: got 0s
}
