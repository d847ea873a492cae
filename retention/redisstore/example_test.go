package redisstore_test

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"

	"github.com/bidikv/bidikv/retention/redisstore"
)

// New takes a client the caller configures and keeps owning. Neither New nor
// the calls below reach the network.
func Example() {
	client := redis.NewClient(&redis.Options{
		Addr:                  "127.0.0.1:6379",
		ContextTimeoutEnabled: true, // let the per-call timeout bound network waits
	})
	defer client.Close()

	s, err := redisstore.New(client, redisstore.WithPrefix("myapp:handles:"))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(s.Key("conversation-42"))

	err = s.Put(context.Background(), "conversation-42", []byte("handle"), 0)
	fmt.Println(errors.Is(err, redisstore.ErrInvalidTTL))

	_, err = redisstore.New(client, redisstore.WithTimeout(0))
	fmt.Println(err)
	// Output:
	// myapp:handles:conversation-42
	// true
	// redisstore: invalid configuration: WithTimeout(0s): must be > 0
}

// NewFromURL reads the usual REDIS_URL form and owns its client. A bad URL
// is reported without the password.
func ExampleNewFromURL() {
	s, err := redisstore.NewFromURL("redis://:s3cret@127.0.0.1:6379/0", redisstore.WithMaxValueBytes(8))
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()
	err = s.Put(context.Background(), "k", []byte("more than eight bytes"), time.Minute)
	fmt.Println(err)

	_, err = redisstore.NewFromURL("redis://:s3cret@127.0.0.1:port/0")
	fmt.Println(err)
	// Output:
	// redisstore: value too large: 21 bytes, limit 8
	// redisstore: invalid configuration: NewFromURL: invalid port ":port" after host
}
