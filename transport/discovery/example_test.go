package discovery_test

import (
	"context"
	"fmt"
	"net"

	"github.com/bidikv/bidikv/transport"
	"github.com/bidikv/bidikv/transport/discovery"
)

// staticDNS answers one headless Service name with two pod addresses.
type staticDNS struct{}

func (staticDNS) LookupHost(_ context.Context, host string) ([]string, error) {
	if host == "vllm-decode.llm.svc.cluster.local" {
		return []string{"10.1.0.8", "10.1.0.7"}, nil
	}
	return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
}

func (staticDNS) LookupSRV(context.Context, string, string, string) (string, []*net.SRV, error) {
	return "", nil, &net.DNSError{Err: "no such host", IsNotFound: true}
}

// A headless Service of vLLM decode engines, each serving two
// data-parallel ranks, kept current by a Watcher. In a program, apply is
// the Router's SetEndpoints and Run runs on its own goroutine.
func Example() {
	src, err := discovery.NewDNS("vllm-decode.llm.svc.cluster.local:8000",
		discovery.WithDPSize(2), discovery.WithResolver(staticDNS{}))
	if err != nil {
		panic(err)
	}
	w, err := discovery.NewWatcher(src, func(eps []transport.Endpoint) error {
		for _, ep := range eps {
			fmt.Println(ep)
		}
		return nil
	})
	if err != nil {
		panic(err)
	}
	if err := w.Refresh(context.Background()); err != nil {
		panic(err)
	}
	fmt.Println(w.Stats().Endpoints, "endpoints")
	// Output:
	// http://10.1.0.7:8000 (rank 0)
	// http://10.1.0.7:8000 (rank 1)
	// http://10.1.0.8:8000 (rank 0)
	// http://10.1.0.8:8000 (rank 1)
	// 4 endpoints
}
