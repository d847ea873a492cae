package retention_test

import (
	"context"
	"fmt"
	"log"
	"time"

	"github.com/bidikv/bidikv/retention"
)

func Example() {
	ctx := context.Background()
	m, err := retention.NewMemory(retention.WithMaxEntries(10_000))
	if err != nil {
		log.Fatal(err)
	}
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

func ExampleWithMaxBytes() {
	ctx := context.Background()
	// Room for two 4 KiB handles under short keys, with their overhead.
	m, err := retention.NewMemory(retention.WithMaxBytes(2 * (4096 + 8 + retention.EntryOverhead)))
	if err != nil {
		log.Fatal(err)
	}
	defer m.Close()

	for _, key := range []string{"conv-1", "conv-2", "conv-3"} {
		if err := m.Put(ctx, key, make([]byte, 4096), time.Hour); err != nil {
			fmt.Println(err)
		}
	}
	// conv-1, the least recently put, made room for conv-3.
	_, ok, _ := m.Take(ctx, "conv-1")
	fmt.Println("conv-1 retained:", ok)
	st := m.Stats()
	fmt.Println("entries:", st.Entries, "evicted for bytes:", st.EvictedForBytes)

	err = m.Put(ctx, "conv-4", make([]byte, 16<<10), time.Hour)
	fmt.Println(err)
	// Output:
	// conv-1 retained: false
	// entries: 2 evicted for bytes: 1
	// retention: value too large: entry of 16486 bytes (key, value and overhead), limit 8400 (WithMaxBytes)
}
