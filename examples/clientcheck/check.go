package main

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httputil"
	"net/url"
	"strings"
	"sync"
	"sync/atomic"
)

// checker forwards requests to the proxy and checks generation answers
// against the plain engine's.
type checker struct {
	proxy, plain *url.URL
	client       *http.Client
	out          io.Writer
	mu           sync.Mutex // out
	n            atomic.Int64
	equal        atomic.Int64
	differ       atomic.Int64
	hits         atomic.Int64
	rp           *httputil.ReverseProxy
}

func newChecker(proxy, plain string, out io.Writer) (*checker, error) {
	pu, err := url.Parse(proxy)
	if err != nil || pu.Host == "" {
		return nil, fmt.Errorf("-proxy %q: not a URL", proxy)
	}
	lu, err := url.Parse(plain)
	if err != nil || lu.Host == "" {
		return nil, fmt.Errorf("-plain %q: not a URL", plain)
	}
	c := &checker{proxy: pu, plain: lu, client: &http.Client{}, out: out}
	c.rp = httputil.NewSingleHostReverseProxy(pu)
	return c, nil
}

// generation reports whether path is one of the four generation APIs.
func generation(path string) bool {
	switch path {
	case "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages":
		return true
	}
	return false
}

func (c *checker) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodPost || !generation(r.URL.Path) {
		c.rp.ServeHTTP(w, r)
		return
	}
	body, err := io.ReadAll(r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	got, err := c.send(r, c.proxy, body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadGateway)
		return
	}
	for k, v := range got.header {
		w.Header()[k] = v
	}
	w.WriteHeader(got.status)
	_, _ = w.Write(got.body)
	// The plain engine's answer is asked for after the client has its own:
	// the client may have gone meanwhile (Codex closes a stream at its
	// last event), which must not cancel the check.
	want, err := c.send(r.WithContext(context.WithoutCancel(r.Context())), c.plain, body)
	n := c.n.Add(1)
	line := fmt.Sprintf("request=%d path=%s input=%s", n, r.URL.Path, lastInput(r.URL.Path, body))
	if err != nil {
		c.differ.Add(1)
		c.print(line + " plain_error=" + err.Error())
		return
	}
	a, b := answerOf(r.URL.Path, got.body), answerOf(r.URL.Path, want.body)
	reuse := got.header.Get("X-Bidikv-Reuse")
	if reuse == "hit" {
		c.hits.Add(1)
	}
	match := got.status == want.status && a == b
	if match {
		c.equal.Add(1)
	} else {
		c.differ.Add(1)
	}
	line += fmt.Sprintf(" status=%d reply_end=%s reuse=%s equal=%v", got.status, a.end, reuse, match)
	if !match {
		line += fmt.Sprintf("\n  proxy: %d %+v\n  plain: %d %+v", got.status, a, want.status, b)
	}
	c.print(line)
}

func (c *checker) print(s string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	fmt.Fprintln(c.out, s)
}

func (c *checker) summary() string {
	return fmt.Sprintf("clientcheck: %d requests, %d answers equal the plain engine's, %d differ; %d reused KV (hit)",
		c.n.Load(), c.equal.Load(), c.differ.Load(), c.hits.Load())
}

type answer struct {
	status int
	header http.Header
	body   []byte
}

// send posts body to base with the client's path, query and end-to-end
// headers, and reads the whole answer.
func (c *checker) send(r *http.Request, base *url.URL, body []byte) (answer, error) {
	u := *base
	u.Path = strings.TrimSuffix(u.Path, "/") + r.URL.Path
	u.RawQuery = r.URL.RawQuery
	req, err := http.NewRequestWithContext(r.Context(), http.MethodPost, u.String(), bytes.NewReader(body))
	if err != nil {
		return answer{}, err
	}
	for k, v := range r.Header {
		switch http.CanonicalHeaderKey(k) {
		case "Connection", "Content-Length", "Accept-Encoding", "Transfer-Encoding":
			continue
		}
		req.Header[k] = v
	}
	resp, err := c.client.Do(req)
	if err != nil {
		return answer{}, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return answer{}, err
	}
	h := resp.Header.Clone()
	h.Del("Content-Length")
	return answer{status: resp.StatusCode, header: h, body: b}, nil
}
