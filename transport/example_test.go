package transport_test

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"time"

	"github.com/bidikv/bidikv/transport"
)

func ExampleParseEndpoint() {
	for _, s := range []string{"[::1]:8100", "http://engine-a:8000/vllm/", "::1:8100"} {
		e, err := transport.ParseEndpoint(s)
		if err != nil {
			fmt.Println(err)
			continue
		}
		fmt.Println(e.JoinPath("/v1/chat/completions"))
	}
	// Output:
	// http://[::1]:8100/v1/chat/completions
	// http://engine-a:8000/vllm/v1/chat/completions
	// transport: invalid endpoint "::1:8100": IPv6 literal must be in brackets, as in [::1]:8100
}

func ExampleRequestHeader() {
	in := http.Header{
		"Authorization":   {"Bearer client-secret"},
		"Accept-Encoding": {"gzip"},
		"Connection":      {"keep-alive"},
		"Content-Type":    {"application/json"},
		"X-Request-Id":    {"req-42"},
	}
	out := transport.RequestHeader(in)
	fmt.Println(len(out), out.Get("Content-Type"), out.Get("X-Request-Id"))
	// Output:
	// 2 application/json req-42
}

func ExampleRetryAfter() {
	now := time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)
	for _, v := range []string{"3", "Sun, 01 Mar 2026 12:00:10 GMT", "later"} {
		d, ok := transport.RetryAfter(http.Header{"Retry-After": {v}}, now)
		fmt.Println(d, ok)
	}
	// Output:
	// 3s true
	// 10s true
	// 0s false
}

func ExampleRetryable() {
	fmt.Println(transport.Retryable(&http.Response{StatusCode: http.StatusServiceUnavailable}, nil))
	fmt.Println(transport.Retryable(&http.Response{StatusCode: http.StatusBadRequest}, nil))
	// Output:
	// true
	// false
}

func ExampleRetry() {
	p := transport.RetryPolicy{InitialInterval: time.Millisecond} // 3 attempts by default
	err := transport.Retry(context.Background(), p, func(attempt int) (time.Duration, error) {
		fmt.Println("attempt", attempt)
		if attempt < 2 {
			return 0, errors.New("503 from prefill") // retried
		}
		return 0, transport.Permanent(errors.New("400 from prefill")) // not retried
	})
	fmt.Println(err)
	// Output:
	// attempt 1
	// attempt 2
	// 400 from prefill
}
