//go:build sidecardiff

package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"mime"
	"net/http"
	"net/http/httptest"
	"net/http/httputil"
	"net/url"
	"os"
	"os/exec"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The differential test runs the same request sequences through llm-d's
// own P/D sidecar (llm-d-router's cmd/pd-sidecar, built by `make
// sidecar-diff` into a temporary directory and named by
// BIDIKV_LLMD_SIDECAR) and through `bidikv-proxy sidecar`, each in front
// of its own simulated engines behind recording proxies, and compares
// what each sends to the engines and what each answers. A difference is
// either absent or matched by one of diffRules, which
// examples/proxy/README.md lists with their reasons.

// diffAPIPaths are the sidecar routes that run a prefill leg.
var diffAPIPaths = []string{"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"}

// recLeg is one request an engine received through its recorder.
type recLeg struct {
	method, path string
	header       http.Header
	body         []byte
	status       int
	answer       bytes.Buffer
}

// recorder is a reverse proxy in front of a simulated engine that keeps
// every POST it forwards, and answers the API POSTs fail names with an
// error of vLLM's shape instead of forwarding them.
type recorder struct {
	srv  *httptest.Server
	mu   sync.Mutex
	legs []*recLeg
	apiN int
	fail func(n int) int // the status for the n-th API POST (0: forward it)
	// cached, when > 0, is the usage.prompt_tokens_details.cached_tokens
	// of the engine's whole chat and completions answers (the simulated
	// engines report none, as vLLM without --enable-prompt-tokens-details).
	cached int64
}

func newRecorder(t *testing.T, target string, fail func(int) int, cached int64) *recorder {
	t.Helper()
	u, err := url.Parse(target)
	require.NoError(t, err)
	rec := &recorder{fail: fail, cached: cached}
	rp := httputil.NewSingleHostReverseProxy(u)
	rp.FlushInterval = -1
	rp.Transport = &http.Transport{}
	rp.ModifyResponse = func(resp *http.Response) error {
		if leg, ok := resp.Request.Context().Value(recLegKey{}).(*recLeg); ok {
			rec.mu.Lock()
			leg.status = resp.StatusCode
			rec.mu.Unlock()
			if err := rec.withCached(resp); err != nil {
				return err
			}
			resp.Body = &teeBody{rc: resp.Body, rec: rec, leg: leg}
		}
		return nil
	}
	rec.srv = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Method != http.MethodPost {
			rp.ServeHTTP(w, r)
			return
		}
		body, err := io.ReadAll(r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		leg := &recLeg{method: r.Method, path: r.URL.Path, header: r.Header.Clone(), body: body}
		rec.mu.Lock()
		rec.legs = append(rec.legs, leg)
		status := 0
		if slices.Contains(diffAPIPaths, r.URL.Path) {
			if rec.fail != nil {
				status = rec.fail(rec.apiN)
			}
			rec.apiN++
		}
		if status != 0 {
			leg.status = status
			msg := fmt.Sprintf(`{"object":"error","message":"the prefill engine is overloaded","type":"ServiceUnavailableError","param":null,"code":%d}`, status)
			leg.answer.WriteString(msg)
		}
		rec.mu.Unlock()
		if status != 0 {
			w.Header().Set("Content-Type", "application/json")
			w.WriteHeader(status)
			_, _ = io.WriteString(w, leg.answer.String())
			return
		}
		// As an engine, which tokenizes before it answers: an answer that
		// starts the moment the body is in can reach llm-d's pass-through
		// (httputil.ReverseProxy) before its transport has read the client's
		// body to EOF; Go's HTTP/1 server closes that body at the first
		// response write, and the stream is cut (use of closed network
		// connection).
		time.Sleep(10 * time.Millisecond)
		r.Body = io.NopCloser(bytes.NewReader(body))
		rp.ServeHTTP(w, r.WithContext(context.WithValue(r.Context(), recLegKey{}, leg)))
	}))
	t.Cleanup(func() {
		rec.srv.Close()
		rp.Transport.(*http.Transport).CloseIdleConnections()
	})
	return rec
}

type recLegKey struct{}

// withCached sets the cached_tokens of a whole chat or completions answer.
func (rec *recorder) withCached(resp *http.Response) error {
	p := resp.Request.URL.Path
	if rec.cached <= 0 || resp.StatusCode != http.StatusOK || (p != "/v1/chat/completions" && p != "/v1/completions") ||
		!strings.HasPrefix(resp.Header.Get("Content-Type"), "application/json") {
		return nil
	}
	b, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil {
		return err
	}
	b, _ = withCachedTokens(b, rec.cached)
	resp.Body = io.NopCloser(bytes.NewReader(b))
	resp.ContentLength = int64(len(b))
	resp.Header.Set("Content-Length", strconv.Itoa(len(b)))
	return nil
}

// teeBody keeps what is read of an engine's answer in its leg.
type teeBody struct {
	rc  io.ReadCloser
	rec *recorder
	leg *recLeg
}

func (b *teeBody) Read(p []byte) (int, error) {
	n, err := b.rc.Read(p)
	b.rec.mu.Lock()
	b.leg.answer.Write(p[:n])
	b.rec.mu.Unlock()
	return n, err
}

func (b *teeBody) Close() error { return b.rc.Close() }

// since returns the legs after the first n, and how many there are.
func (rec *recorder) since(n int) ([]recLeg, int) {
	rec.mu.Lock()
	defer rec.mu.Unlock()
	var out []recLeg
	for _, l := range rec.legs[n:] {
		out = append(out, recLeg{method: l.method, path: l.path, header: l.header, body: l.body, status: l.status,
			answer: *bytes.NewBuffer(bytes.Clone(l.answer.Bytes()))})
	}
	return out, len(rec.legs)
}

func (rec *recorder) hostPort() string { return strings.TrimPrefix(rec.srv.URL, "http://") }

// startLLMDSidecar runs llm-d's pd-sidecar binary with the local engine on
// localhost:dport (as llm-d names it) and plain HTTP, and returns its URL.
func startLLMDSidecar(t *testing.T, bin, dport string, args ...string) string {
	t.Helper()
	port := freePorts(t, 1)[0]
	all := append([]string{"--port", port, "--model-server-port", dport, "--secure-proxy=false", "--kv-connector", "nixlv2"}, args...)
	cmd := exec.Command(bin, all...)
	out := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = out, out
	require.NoError(t, cmd.Start())
	waited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(waited) }()
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		<-waited
		if t.Failed() {
			t.Logf("llm-d sidecar output:\n%s", out.String())
		}
	})
	base := "http://127.0.0.1:" + port
	client := &http.Client{Transport: &http.Transport{}, Timeout: time.Second}
	defer client.CloseIdleConnections()
	for range 500 {
		if resp, err := client.Get(base + "/health"); err == nil {
			_ = resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				return base
			}
		}
		select {
		case <-waited:
			require.FailNow(t, "llm-d's sidecar stopped", out.String())
		case <-time.After(20 * time.Millisecond):
		}
	}
	require.FailNow(t, "llm-d's sidecar did not answer /health", out.String())
	return ""
}

// diffScenario is one request sequence.
type diffScenario struct {
	name   string
	path   string
	stream bool
	header bool
	turns  int
	fail   func(n int) int // the named prefill engine's failures
	// clientKV: the client's body carries a kv_transfer_params of its own.
	clientKV bool
}

// diffSide is one sidecar with its engines: the prefill engine the header
// names first, the other one it names, the local decode engine.
type diffSide struct {
	name       string
	url        string
	p, q, d    *recorder
	client     *http.Client
	scenario   diffScenario
	prefillHdr string
}

func newDiffSide(t *testing.T, name, bin string, sc diffScenario) *diffSide {
	t.Helper()
	cl := kvroutetest.NewCluster(t, 2, 1)
	s := &diffSide{name: name, scenario: sc}
	s.p = newRecorder(t, cl.Prefill[0].URL(), sc.fail, 32)
	s.q = newRecorder(t, cl.Prefill[1].URL(), nil, 32)
	s.d = newRecorder(t, cl.Decode[0].URL(), nil, 0)
	s.prefillHdr = s.p.hostPort() + "," + s.q.hostPort()
	retries := []string{"--prefill-max-retries", "2", "--prefill-retry-backoff", "10ms"}
	if bin != "" {
		_, dport, _ := strings.Cut(s.d.hostPort(), ":")
		s.url = startLLMDSidecar(t, bin, dport, retries...)
	} else {
		s.url = startSidecar(t, s.d.srv.URL, retries...).url
	}
	s.client = &http.Client{Transport: &http.Transport{}, Timeout: 30 * time.Second}
	t.Cleanup(s.client.CloseIdleConnections)
	return s
}

// diffClient is the client of one scenario: an agent of chat, Responses
// or Messages (agentClient), or a completions client.
type diffClient struct {
	agent  *agentClient
	prompt string // completions
	stream bool
	last   agentTurn
}

func newDiffClient(sc diffScenario) *diffClient {
	c := &diffClient{stream: sc.stream}
	switch sc.path {
	case "/v1/chat/completions":
		base := chatAgentBody()
		if sc.stream {
			base["stream_options"] = map[string]any{"include_usage": true}
		}
		c.agent = &agentClient{path: sc.path, stream: sc.stream, base: base}
	case "/v1/responses":
		c.agent = &agentClient{path: sc.path, stream: sc.stream, base: codexBody("diff-" + sc.name)}
	case "/v1/messages":
		c.agent = &agentClient{path: sc.path, stream: sc.stream, base: claudeBody("diff-" + sc.name)}
	default:
		c.prompt = agentSystem + "\nQuestion: what should the agent do first?\nAnswer:"
	}
	if c.agent != nil {
		c.agent.session = "diff-" + sc.name
		if sc.clientKV {
			c.agent.base["kv_transfer_params"] = map[string]any{"do_remote_decode": false, "do_remote_prefill": true,
				"remote_engine_id": "client-chosen", "remote_request_id": "client-chosen", "remote_block_ids": []any{[]any{1, 2, 3}},
				"remote_host": "127.0.0.1", "remote_port": 1}
		}
	}
	return c
}

// next returns turn i's body and headers.
func (c *diffClient) next(i int) ([]byte, http.Header) {
	if c.agent == nil {
		m := map[string]any{"model": "sim-model", "prompt": c.prompt, "max_tokens": 16, "stream": c.stream}
		if c.stream {
			m["stream_options"] = map[string]any{"include_usage": true}
		}
		b, _ := json.Marshal(m)
		h := http.Header{}
		h.Set("Content-Type", "application/json")
		return b, h
	}
	if i == 0 || len(c.last.calls) == 0 {
		c.agent.ask(agentAsk(c.agent.session, i))
	} else {
		c.agent.results(c.last, i)
	}
	return c.agent.body(), c.agent.header(i)
}

// answered reads turn i's answer into the conversation.
func (c *diffClient) answered(t *testing.T, b []byte) {
	t.Helper()
	if c.agent == nil {
		c.prompt += completionText(b) + "\nQuestion: and then?\nAnswer:"
		return
	}
	var out agentTurn
	if c.stream {
		c.agent.readStream(t, b, &out)
	} else {
		c.agent.readBody(t, b, &out)
	}
	c.agent.items = append(c.agent.items, out.echo...)
	c.last = out
}

// completionText is the text of a completions answer, whole or streamed.
func completionText(b []byte) string {
	var text string
	for _, data := range dataLines(b) {
		var ev struct {
			Choices []struct{ Text string } `json:"choices"`
		}
		if json.Unmarshal(data, &ev) == nil && len(ev.Choices) > 0 {
			text += ev.Choices[0].Text
		}
	}
	return text
}

// dataLines are an answer's JSON documents: the body, or each event's data.
func dataLines(b []byte) [][]byte {
	if !bytes.HasPrefix(bytes.TrimSpace(b), []byte("data:")) && !bytes.HasPrefix(bytes.TrimSpace(b), []byte("event:")) {
		return [][]byte{b}
	}
	var out [][]byte
	for _, l := range bytes.Split(b, []byte("\n")) {
		if d, ok := bytes.CutPrefix(bytes.TrimRight(l, "\r"), []byte("data: ")); ok && !bytes.Equal(d, []byte("[DONE]")) {
			out = append(out, d)
		}
	}
	return out
}

// diffTurn is what one side did for one turn, as named facts.
type diffTurn map[string]string

// run sends the scenario's turns through the side's sidecar and returns
// the facts of each turn.
func (s *diffSide) run(t *testing.T, c *diffClient) []diffTurn {
	t.Helper()
	var out []diffTurn
	np, nq, nd := 0, 0, 0
	for i := range s.scenario.turns {
		body, hdr := c.next(i)
		req, err := http.NewRequest(http.MethodPost, s.url+s.scenario.path, bytes.NewReader(body))
		require.NoError(t, err)
		req.Header = hdr
		if i != 1 { // turn 2 comes without an id
			req.Header.Set("X-Request-Id", fmt.Sprintf("client-%s-%d", strings.ReplaceAll(s.scenario.name, " ", "_"), i))
		}
		req.Header.Set("X-Client-Custom", "kept")
		req.Header.Set("Authorization", "Bearer client-token")
		if s.scenario.header {
			req.Header.Set("x-prefiller-host-port", s.prefillHdr)
		}
		resp, err := s.client.Do(req)
		require.NoError(t, err)
		answer, err := io.ReadAll(resp.Body)
		_ = resp.Body.Close()
		require.NoError(t, err, "%s sidecar, turn %d: the answer so far: %s", s.name, i+1, answer)
		// The engines' legs of this turn (a sidecar's background work,
		// none here, would show as other legs).
		var p, q, d []recLeg
		p, np = s.p.since(np)
		q, nq = s.q.since(nq)
		d, nd = s.d.since(nd)
		f := diffTurn{}
		answerFacts(f, resp, answer)
		id := req.Header.Get("X-Request-Id")
		legFacts(f, "P", p, body, id, nil)
		legFacts(f, "P2", q, body, id, nil)
		legFacts(f, "D", d, body, id, lastHandle(p))
		f["P and D legs share their x-request-id"] = strconv.FormatBool(sharedID(p, d))
		out = append(out, f)
		if resp.StatusCode != http.StatusOK {
			break
		}
		c.answered(t, answer)
	}
	return out
}

// sharedID reports whether the last prefill API leg and the decode API
// leg carry the same X-Request-Id values (false without both).
func sharedID(p, d []recLeg) bool {
	var pid, did []string
	for _, l := range p {
		if slices.Contains(diffAPIPaths, l.path) {
			pid = l.header.Values("X-Request-Id")
		}
	}
	for _, l := range d {
		if slices.Contains(diffAPIPaths, l.path) {
			did = l.header.Values("X-Request-Id")
		}
	}
	return len(pid) > 0 && slices.Equal(pid, did)
}

// lastHandle is the kv_transfer_params of the last successful API answer
// among legs (nil when none).
func lastHandle(legs []recLeg) json.RawMessage {
	var h json.RawMessage
	for _, l := range legs {
		if l.status != http.StatusOK || !slices.Contains(diffAPIPaths, l.path) {
			continue
		}
		var m map[string]json.RawMessage
		if json.Unmarshal(l.answer.Bytes(), &m) == nil {
			h = m["kv_transfer_params"]
		}
	}
	return h
}

// answerFacts are the facts of the answer a client received.
func answerFacts(f diffTurn, resp *http.Response, b []byte) {
	f["answer status"] = strconv.Itoa(resp.StatusCode)
	mt, _, _ := mime.ParseMediaType(resp.Header.Get("Content-Type"))
	f["answer content-type"] = mt
	docs := dataLines(b)
	var shapes []string
	cached, handle, text := "absent", "absent", ""
	for _, d := range docs {
		var m map[string]json.RawMessage
		if json.Unmarshal(d, &m) != nil {
			shapes = append(shapes, "not JSON")
			continue
		}
		if _, ok := m["kv_transfer_params"]; ok && string(m["kv_transfer_params"]) != "null" {
			handle = "present"
		}
		if n, ok := cachedTokens(d); ok {
			cached = strconv.FormatInt(n, 10)
		}
		shapes = append(shapes, jsonKeys(m, "kv_transfer_params"))
	}
	f["answer shape"] = strings.Join(dedup(shapes), " | ")
	f["answer kv_transfer_params"] = handle
	f["answer cached_tokens"] = cached
	text = completionText(b)
	f["answer choices text"] = text
	if resp.StatusCode != http.StatusOK {
		f["answer body"] = "error"
	}
}

// jsonKeys is a JSON object's sorted keys but the skipped ones.
func jsonKeys(m map[string]json.RawMessage, skip ...string) string {
	var ks []string
	for k := range m {
		if !slices.Contains(skip, k) {
			ks = append(ks, k)
		}
	}
	sort.Strings(ks)
	return "{" + strings.Join(ks, ",") + "}"
}

func dedup(s []string) []string {
	var out []string
	for _, v := range s {
		if len(out) == 0 || out[len(out)-1] != v {
			out = append(out, v)
		}
	}
	return out
}

// diffHeaderNoise are headers each HTTP stack sets its own way.
var diffHeaderNoise = []string{"Content-Length", "Accept-Encoding", "User-Agent", "Traceparent", "Tracestate"}

// legFacts are the facts of the legs one engine received in a turn: how
// many API legs with their statuses, the other POSTs, and the first and
// last API legs' bodies and headers as compared with the client's body.
// handle is P's answered handle, which the D leg should carry.
func legFacts(f diffTurn, role string, legs []recLeg, client []byte, clientID string, handle json.RawMessage) {
	var api []recLeg
	var other []string
	for _, l := range legs {
		if slices.Contains(diffAPIPaths, l.path) {
			api = append(api, l)
		} else {
			other = append(other, l.path)
		}
	}
	var statuses []string
	for _, l := range api {
		statuses = append(statuses, l.path+" "+strconv.Itoa(l.status))
	}
	f[role+" API legs"] = strings.Join(statuses, ", ")
	sort.Strings(other)
	f[role+" other legs"] = strings.Join(other, ", ")
	if len(api) == 0 {
		return
	}
	var cm map[string]json.RawMessage
	_ = json.Unmarshal(client, &cm)
	for which, l := range map[string]recLeg{"first": api[0], "last": api[len(api)-1]} {
		if which == "last" && len(api) == 1 {
			continue
		}
		k := role + " " + which + " leg "
		var m map[string]json.RawMessage
		if json.Unmarshal(l.body, &m) != nil {
			f[k+"body"] = "not JSON"
			continue
		}
		f[k+"kv_transfer_params"] = handleKind(m["kv_transfer_params"], handle)
		for _, key := range []string{"stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"} {
			f[k+key] = valueOf(m, key)
		}
		// Each other member that is not the client's: "added V", "removed"
		// or "changed to V".
		seen := []string{"kv_transfer_params", "stream", "stream_options", "max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"}
		for key, v := range m {
			switch cv, ok := cm[key]; {
			case slices.Contains(seen, key):
			case !ok:
				f[k+"member "+key] = "added " + string(v)
			case !jsonEqual(cv, v):
				f[k+"member "+key] = "changed to " + string(v)
			}
		}
		for key := range cm {
			if _, ok := m[key]; !ok && !slices.Contains(seen, key) {
				f[k+"member "+key] = "removed"
			}
		}
		ids := l.header.Values("X-Request-Id")
		idf := strconv.Itoa(len(ids)) + " value(s):"
		for _, id := range ids {
			switch {
			case clientID == "":
				idf += " another"
			case id == clientID:
				idf += " the client's"
			case strings.HasPrefix(id, clientID):
				idf += " the client's with a suffix"
			default:
				idf += " another"
			}
		}
		f[k+"x-request-id"] = idf
		for h := range l.header {
			if !slices.Contains(diffHeaderNoise, h) && h != "X-Request-Id" {
				f[k+"header "+h] = "present"
			}
		}
	}
}

// handleKind names a leg's kv_transfer_params: absent, the miss handle,
// P's answered handle, a decode engine's handle, or other.
func handleKind(raw, pHandle json.RawMessage) string {
	if len(raw) == 0 || string(raw) == "null" {
		return "absent"
	}
	if len(pHandle) > 0 && jsonEqual(raw, pHandle) {
		return "P's answered handle"
	}
	var m map[string]any
	if json.Unmarshal(raw, &m) != nil {
		return "not an object"
	}
	if m["do_remote_decode"] == true && m["do_remote_prefill"] == false && m["remote_engine_id"] == nil &&
		m["remote_block_ids"] == nil && m["remote_host"] == nil && m["remote_port"] == nil {
		if len(m) == 6 {
			return "miss handle"
		}
		return "miss handle with more members"
	}
	if m["do_remote_decode"] == true && m["remote_engine_id"] != nil {
		return "a decode engine's handle (do_remote_decode)"
	}
	if m["do_remote_prefill"] == true {
		return "a prefill engine's handle, not P's answered one"
	}
	return "other"
}

func valueOf(m map[string]json.RawMessage, key string) string {
	v, ok := m[key]
	if !ok {
		return "absent"
	}
	return string(v)
}

func jsonEqual(a, b json.RawMessage) bool {
	var x, y any
	if json.Unmarshal(a, &x) != nil || json.Unmarshal(b, &y) != nil {
		return false
	}
	xa, _ := json.Marshal(x)
	ya, _ := json.Marshal(y)
	return bytes.Equal(xa, ya)
}

// diffRule is a deliberate difference: it matches a fact of a turn whose
// values differ between llm-d's sidecar and bidikv's.
type diffRule struct {
	name   string
	reason string
	match  func(sc diffScenario, turn int, key, llmd, bidikv string) bool
}

// TestDifferential runs diffScenarios through llm-d's sidecar and
// bidikv's and fails on every difference no rule of diffRules matches.
func TestDifferential(t *testing.T) {
	bin := os.Getenv("BIDIKV_LLMD_SIDECAR")
	if bin == "" {
		t.Skip("BIDIKV_LLMD_SIDECAR is not set: `make sidecar-diff` builds llm-d's pd-sidecar and runs this test")
	}
	used := map[string]int{}
	for _, sc := range diffScenarios() {
		t.Run(sc.name, func(t *testing.T) {
			llmd := newDiffSide(t, "llm-d", bin, sc)
			ours := newDiffSide(t, "bidikv", "", sc)
			a := llmd.run(t, newDiffClient(sc))
			b := ours.run(t, newDiffClient(sc))
			require.Equal(t, len(a), len(b), "turns answered")
			checkDiffFacts(t, sc, a)
			for i := range a {
				compareTurn(t, sc, i, a[i], b[i], used)
			}
		})
	}
	for _, r := range diffRules {
		t.Logf("deliberate difference %-40q matched %3d facts: %s", r.name, used[r.name], r.reason)
	}
}

// diffScenarios are the request sequences: each API streamed and not, with
// and without the header; prefill failures; a client's own handle.
func diffScenarios() []diffScenario {
	var out []diffScenario
	name := func(path string, stream bool) string {
		n := strings.ReplaceAll(strings.TrimPrefix(path, "/v1/"), "/", "-")
		if stream {
			n += " stream"
		}
		return n
	}
	for _, path := range diffAPIPaths {
		for _, stream := range []bool{false, true} {
			out = append(out, diffScenario{name: name(path, stream), path: path, stream: stream, header: true, turns: 3},
				diffScenario{name: name(path, stream) + " no header", path: path, stream: stream, turns: 3})
		}
	}
	once := func(n int) int {
		if n == 0 {
			return http.StatusServiceUnavailable
		}
		return 0
	}
	always := func(int) int { return http.StatusServiceUnavailable }
	for _, path := range []string{"/v1/chat/completions", "/v1/messages"} {
		for _, stream := range []bool{false, true} {
			out = append(out,
				diffScenario{name: name(path, stream) + " P 503 then 200", path: path, stream: stream, header: true, turns: 2, fail: once},
				diffScenario{name: name(path, stream) + " P 503 always", path: path, stream: stream, header: true, turns: 1, fail: always})
		}
	}
	return append(out,
		diffScenario{name: "chat client kv_transfer_params", path: "/v1/chat/completions", header: true, turns: 1, clientKV: true},
		diffScenario{name: "chat client kv_transfer_params no header", path: "/v1/chat/completions", turns: 1, clientKV: true})
}

// compareTurn fails on each fact of turn i that differs between llm-d's
// sidecar (a) and bidikv's (b) and that no rule matches; used counts each
// rule's matches.
func compareTurn(t *testing.T, sc diffScenario, i int, a, b diffTurn, used map[string]int) {
	t.Helper()
	keys := map[string]bool{}
	for k := range a {
		keys[k] = true
	}
	for k := range b {
		keys[k] = true
	}
	sorted := make([]string, 0, len(keys))
	for k := range keys {
		sorted = append(sorted, k)
	}
	sort.Strings(sorted)
	for _, k := range sorted {
		x, y := valueOrNone(a, k), valueOrNone(b, k)
		if x == y {
			continue
		}
		matched := false
		for _, r := range diffRules {
			if r.match(sc, i, k, x, y) {
				used[r.name]++
				matched = true
				break
			}
		}
		if !matched {
			t.Errorf("turn %d: %s: llm-d %q, bidikv %q: a difference no rule lists", i+1, k, x, y)
		}
	}
}

// valueOrNone is fact k of f, "(none)" when f has none.
func valueOrNone(f diffTurn, k string) string {
	if v, ok := f[k]; ok {
		return v
	}
	return "(none)"
}

// checkDiffFacts checks that the setup exercises what the comparison
// relies on, on llm-d's side (bidikv's equal facts then hold too): a
// header's turn has a prefill leg on the first engine it names and none
// on the other, the decode leg carries P's answered handle, chat and
// completions answers carry P's cached_tokens, no engine sees the
// picker's header, and a turn without the header has no prefill leg.
func checkDiffFacts(t *testing.T, sc diffScenario, turns []diffTurn) {
	t.Helper()
	for i, f := range turns {
		for k, v := range f {
			require.NotContains(t, k, "X-Prefiller-Host-Port", "turn %d: %s %s", i+1, k, v)
		}
		require.Empty(t, f["P2 API legs"], "turn %d: only the header's first engine prefills", i+1)
		if !sc.header {
			require.Empty(t, f["P API legs"], "turn %d: without the header no prefill leg", i+1)
			if !sc.clientKV {
				require.Equal(t, "absent", f["D first leg kv_transfer_params"], "turn %d", i+1)
			}
			continue
		}
		require.NotEmpty(t, f["P API legs"], "turn %d", i+1)
		if f["answer status"] != "200" {
			require.Equal(t, "(none)", valueOr(f, "D API legs"), "turn %d: no decode leg after a failed prefill", i+1)
			continue
		}
		require.Equal(t, "P's answered handle", f["D first leg kv_transfer_params"], "turn %d", i+1)
		require.Equal(t, "miss handle", f["P first leg kv_transfer_params"], "turn %d", i+1)
		if sc.path == "/v1/chat/completions" || sc.path == "/v1/completions" {
			require.Equal(t, "32", f["answer cached_tokens"], "turn %d: P's count", i+1)
		}
	}
}

func valueOr(f diffTurn, k string) string {
	if v, ok := f[k]; ok && v != "" {
		return v
	}
	return "(none)"
}

// diffRules are the deliberate differences, each with its reason (the
// proxy README's sidecar section lists them with llm-d's code).
var diffRules = []diffRule{
	{name: "reuse", reason: "from turn 2 bidikv attaches the handle the decode engine retained (bidirectional reuse); llm-d sends the miss handle every turn",
		match: func(sc diffScenario, turn int, key, llmd, bidikv string) bool {
			return sc.header && turn > 0 && strings.HasPrefix(key, "P ") && strings.HasSuffix(key, " leg kv_transfer_params") &&
				llmd == "miss handle" && bidikv == "a decode engine's handle (do_remote_decode)"
		}},
	{name: "prefill token limits", reason: "both cap the prefill leg at one token: llm-d sets every limit member of the API to 1, bidikv sets max_tokens 1 and removes max_completion_tokens and min_tokens",
		match: func(_ diffScenario, _ int, key, llmd, bidikv string) bool {
			return strings.HasPrefix(key, "P ") && (strings.HasSuffix(key, " leg max_completion_tokens") || strings.HasSuffix(key, " leg min_tokens")) &&
				llmd == "1" && bidikv == "absent"
		}},
	{name: "prefill finishes on length", reason: "bidikv's prefill leg sets ignore_eos so that P finishes on its length cap and returns a handle (engines that emit one only on length)",
		match: func(_ diffScenario, _ int, key, llmd, bidikv string) bool {
			return strings.HasPrefix(key, "P ") && strings.HasSuffix(key, " leg member ignore_eos") && llmd == "(none)" && bidikv == "added true"
		}},
	{name: "token verification", reason: "bidikv asks for token ids (return_token_ids, renders, /tokenize probes) to verify a handle's tokens before P reads them, and removes the ids it asked for from the answer",
		match: func(_ diffScenario, _ int, key, llmd, bidikv string) bool {
			switch {
			case strings.HasSuffix(key, " leg member return_token_ids"):
				return llmd == "(none)" && bidikv == "added true"
			case key == "answer shape":
				var shapes []string
				for _, sh := range strings.Split(llmd, " | ") {
					shapes = append(shapes, strings.Replace(sh, ",prompt_token_ids", "", 1))
				}
				return strings.Join(dedup(shapes), " | ") == bidikv
			case strings.HasSuffix(key, " other legs"):
				if llmd != "" {
					return false
				}
				for _, p := range strings.Split(bidikv, ", ") {
					if p != "/tokenize" && !strings.HasSuffix(p, "/render") {
						return false
					}
				}
				return true
			}
			return false
		}},
	{name: "handles scrubbed", reason: "no handle reaches a client with bidikv; llm-d returns the decode engine's kv_transfer_params",
		match: func(_ diffScenario, _ int, key, llmd, bidikv string) bool {
			return key == "answer kv_transfer_params" && llmd == "present" && bidikv == "absent"
		}},
	{name: "request ids", reason: "bidikv sends one X-Request-Id on every leg, the client's with a random suffix (unique per turn on the engines) or its own; llm-d adds a fresh UUID to the client's, so each leg carries two values, and forwards a turn without the header as it came, with no id when the client sent none",
		match: func(sc diffScenario, _ int, key, llmd, bidikv string) bool {
			if !strings.HasSuffix(key, " leg x-request-id") {
				return false
			}
			return llmd == "2 value(s): the client's another" && bidikv == "1 value(s): the client's with a suffix" ||
				!sc.header && llmd == "0 value(s):" && bidikv == "1 value(s): another"
		}},
	{name: "X-Forwarded-For", reason: "llm-d's legs go through httputil.ReverseProxy, which adds X-Forwarded-For; bidikv's legs are its own requests",
		match: func(_ diffScenario, _ int, key, llmd, bidikv string) bool {
			return strings.HasSuffix(key, " leg header X-Forwarded-For") && llmd == "present" && bidikv == "(none)"
		}},
	{name: "client credentials", reason: "bidikv never forwards the client's Authorization to an engine (it sends --upstream-api-key when set); llm-d's legs carry the client's",
		match: func(_ diffScenario, _ int, key, llmd, bidikv string) bool {
			return strings.HasSuffix(key, " leg header Authorization") && llmd == "present" && bidikv == "(none)"
		}},
	{name: "cached_tokens on Responses and Messages", reason: "bidikv rewrites cached_tokens on chat and completions only; llm-d adds chat's usage.prompt_tokens_details to any answer with a usage, Responses and Messages included",
		match: func(sc diffScenario, _ int, key, _, bidikv string) bool {
			return key == "answer cached_tokens" && sc.header && (sc.path == "/v1/responses" || sc.path == "/v1/messages") && bidikv == "absent"
		}},
	{name: "client handles removed", reason: "without the header bidikv removes a client's kv_transfer_params before the local engine sees it; llm-d forwards the request as it came, so the client's handle reaches vLLM (here it names an unreachable engine: the read fails, 500)",
		match: func(sc diffScenario, _ int, key, llmd, bidikv string) bool {
			if !sc.clientKV || sc.header {
				return false
			}
			if key == "D first leg kv_transfer_params" {
				return llmd == "a prefill engine's handle, not P's answered one" && bidikv == "absent"
			}
			// What follows from it: D's failed read and its error answer.
			return slices.Contains([]string{"D API legs", "answer status", "answer body", "answer shape"}, key)
		}},
	{name: "prefill failure answer", reason: "after the retries, bidikv answers in the API's error shape naming the prefill phase; llm-d forwards the prefill engine's status and body (same status here)",
		match: func(sc diffScenario, turn int, key, llmd, bidikv string) bool {
			return sc.fail != nil && turn == 0 && key == "answer shape" && llmd == "{code,message,object,param,type}" &&
				(bidikv == "{error}" || bidikv == "{error,type}")
		}},
}
