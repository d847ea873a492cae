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

// The scheme picks the deployment: redis-sentinel:// names Sentinels and
// the primary they monitor, redis-cluster:// seed nodes of a Redis Cluster.
// Several router replicas given the same URL share the handles.
func ExampleNewFromURL_deployments() {
	for _, u := range []string{
		"redis-sentinel://10.0.0.1:26379,10.0.0.2:26379/0?master_name=bidikv", // addr=, not commas
		"redis-sentinel://10.0.0.1:26379/0?addr=10.0.0.2:26379&addr=10.0.0.3:26379",
		"redis-sentinel://10.0.0.1:26379/0?master_name=bidikv&addr=10.0.0.2:26379&addr=10.0.0.3:26379&password=s3cret",
		"redis-cluster://10.0.1.1:6379?addr=10.0.1.2:6379&addr=10.0.1.3:6379",
	} {
		s, err := redisstore.NewFromURL(u, redisstore.WithWaitReplicas(1))
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println("ok")
		_ = s.Close()
	}
	// Output:
	// redisstore: invalid configuration: NewFromURL: one host:port after the scheme; name more with addr=host:port query parameters, not commas
	// redisstore: invalid configuration: NewFromURL: a Sentinel URL needs master_name=NAME
	// ok
	// ok
}
