package kvroutetest

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// Hostile decode engines: answers a router must never pass on with a KV
// handle in them. A real vLLM engine puts its handle at the top level of a
// body, or of a stream's final event; a broken or hostile engine, or a tap
// in front of one, may put it anywhere and spell it any way. HostileAnswers
// lists such answers for each API, streaming and not, and HostileEngine
// serves them; CheckLeak is the oracle that tells whether any of the
// handle reached a client.

// The distinctive values of the handles hostile answers carry: the decode
// handle's (HostileHandle) and the prefill handle's a HostileEngine
// answers prefill legs with. None of them appears anywhere else, so a
// client that sees one has seen (part of) a handle.
const (
	HostileEngineID         = "hostile-engine-5f3c9a"
	HostileRequestID        = "hostile-request-81d0e4"
	HostileHost             = "10.213.7.91"
	HostilePrefillEngineID  = "hostile-prefill-2b7e61"
	HostilePrefillRequestID = "hostile-prefill-request-c40a"
)

// HostileHandle is the decode handle every hostile answer carries, as vLLM
// writes one (remote_blocks_expiry_time on the engine's monotonic clock).
const HostileHandle = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[11,12,13]],` +
	`"remote_engine_id":"` + HostileEngineID + `","remote_request_id":"` + HostileRequestID + `",` +
	`"remote_host":"` + HostileHost + `","remote_port":47391,"tp_size":1,"remote_num_tokens":40,` +
	`"remote_blocks_expiry_time":1234.5}`

// hostilePrefillHandle is the prefill handle of a HostileEngine's answers
// to prefill legs.
const hostilePrefillHandle = `{"do_remote_prefill":true,"do_remote_decode":false,"remote_block_ids":[[1,2,3]],` +
	`"remote_engine_id":"` + HostilePrefillEngineID + `","remote_request_id":"` + HostilePrefillRequestID + `",` +
	`"remote_host":"` + HostileHost + `","remote_port":47390,"tp_size":1}`

// HostileSecrets returns the distinctive values of the hostile handles,
// for CheckLeak.
func HostileSecrets() []string {
	return []string{HostileEngineID, HostileRequestID, HostileHost, HostilePrefillEngineID, HostilePrefillRequestID}
}

// HandleMembers are the names of kv_transfer_params and of a handle's
// members. A client never has a reason to see a JSON member with one of
// these names in an engine's answer.
var HandleMembers = []string{
	"kv_transfer_params", "do_remote_decode", "do_remote_prefill", "remote_block_ids", "remote_engine_id",
	"remote_request_id", "remote_host", "remote_port", "remote_num_tokens", "remote_blocks_expiry_time",
}

// HostileAnswer is one malformed answer of a decode engine, as sent.
type HostileAnswer struct {
	// Name says what is malformed ("escaped key in choices[0].message",
	// "gzip with Content-Encoding", ...).
	Name string
	// Path and Stream are the API and mode the answer is for.
	Path   string
	Stream bool
	// Status, Header and Body are the answer: a stream's events are its
	// Body, sent in one write.
	Status int
	Header http.Header
	Body   []byte
	// Clean, when not nil, is what a router should forward: the same
	// answer with every kv_transfer_params member removed (the handle is
	// removable: it sits in a kv_transfer_params member, whatever its
	// spelling and depth, of an answer that is otherwise well formed).
	// When nil, failing closed (an error instead of the answer) is right.
	Clean []byte
}

// HostileEngine serves one HostileAnswer at a time on 127.0.0.1: every
// POST whose kv_transfer_params has do_remote_decode true (a prefill leg)
// gets a well-formed one-token answer with a prefill handle; every other
// POST (a decode leg) gets the answer. Safe for concurrent use.
type HostileEngine struct {
	srv     *httptest.Server
	mu      sync.Mutex
	answer  HostileAnswer
	decodes atomic.Int64
	encoded atomic.Int64 // requests that carried an Accept-Encoding
	once    sync.Once
}

// NewHostileEngine starts a HostileEngine that serves a; tb.Cleanup
// closes it.
func NewHostileEngine(tb testing.TB, a HostileAnswer) *HostileEngine {
	tb.Helper()
	e := &HostileEngine{answer: a}
	e.srv = httptest.NewServer(http.HandlerFunc(e.serve))
	tb.Cleanup(e.Close)
	return e
}

// URL returns the engine's base URL.
func (e *HostileEngine) URL() string { return e.srv.URL }

// SetAnswer makes the engine serve a from now on.
func (e *HostileEngine) SetAnswer(a HostileAnswer) {
	e.mu.Lock()
	e.answer = a
	e.mu.Unlock()
}

// DecodeLegs returns the number of decode legs served.
func (e *HostileEngine) DecodeLegs() int64 { return e.decodes.Load() }

// AcceptEncodings returns the number of requests that carried an
// Accept-Encoding header: a router must never ask an engine for a
// compressed answer, which it could not inspect.
func (e *HostileEngine) AcceptEncodings() int64 { return e.encoded.Load() }

// Close stops the engine; it is safe to call more than once.
func (e *HostileEngine) Close() {
	e.once.Do(func() {
		e.srv.CloseClientConnections()
		e.srv.Close()
	})
}

func (e *HostileEngine) serve(w http.ResponseWriter, r *http.Request) {
	body, _ := io.ReadAll(r.Body)
	if len(r.Header.Values("Accept-Encoding")) > 0 {
		e.encoded.Add(1)
	}
	if r.Method != http.MethodPost {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	var req struct {
		KV *struct {
			DoRemoteDecode bool `json:"do_remote_decode"`
		} `json:"kv_transfer_params"`
	}
	_ = json.Unmarshal(body, &req)
	if req.KV != nil && req.KV.DoRemoteDecode {
		w.Header().Set("Content-Type", "application/json")
		_, _ = io.WriteString(w, prefillAnswerFor(r.URL.Path))
		return
	}
	if bytes.HasSuffix([]byte(r.URL.Path), []byte("/render")) || r.URL.Path == "/tokenize" {
		http.Error(w, "not found", http.StatusNotFound)
		return
	}
	e.decodes.Add(1)
	e.mu.Lock()
	a := e.answer
	e.mu.Unlock()
	for k, v := range a.Header {
		w.Header()[k] = v
	}
	status := a.Status
	if status == 0 {
		status = http.StatusOK
	}
	w.WriteHeader(status)
	_, _ = w.Write(a.Body)
	if f, ok := w.(http.Flusher); ok {
		f.Flush()
	}
}

// prefillAnswerFor is a prefill engine's one-token answer for the API at
// path, with the hostile prefill handle at its top level.
func prefillAnswerFor(path string) string {
	switch path {
	case PathResponses:
		return `{"id":"resp_p","object":"response","status":"incomplete","incomplete_details":{"reason":"max_output_tokens"},"output":[],"kv_transfer_params":` + hostilePrefillHandle + `}`
	case PathMessages:
		return `{"id":"msg_p","type":"message","role":"assistant","content":[{"type":"text","text":"x"}],"stop_reason":"max_tokens","usage":{"input_tokens":5,"output_tokens":1},"kv_transfer_params":` + hostilePrefillHandle + `}`
	case PathCompletions:
		return `{"id":"cmpl-p","object":"text_completion","choices":[{"index":0,"text":"x","finish_reason":"length"}],"kv_transfer_params":` + hostilePrefillHandle + `}`
	}
	return `{"id":"chatcmpl-p","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"x"},"finish_reason":"length"}],"kv_transfer_params":` + hostilePrefillHandle + `}`
}

// hostileRequest is a minimal request of the API at path.
func hostileRequest(path string, stream bool) string {
	switch path {
	case PathCompletions:
		return fmt.Sprintf(`{"model":"m","prompt":"hi","max_tokens":8,"stream":%v}`, stream)
	case PathResponses:
		return fmt.Sprintf(`{"model":"m","input":"hi","max_output_tokens":8,"stream":%v}`, stream)
	case PathMessages:
		return fmt.Sprintf(`{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}],"stream":%v}`, stream)
	}
	return fmt.Sprintf(`{"model":"m","messages":[{"role":"user","content":"hi"}],"max_tokens":8,"stream":%v}`, stream)
}

// TestHostile runs every HostileAnswer of the four APIs (PathChat,
// PathCompletions, PathResponses, PathMessages), streaming and not,
// through the router (or a proxy in front of one) at url, whose only
// decode engine is e, with client (give it a transport with
// DisableCompression, so that it sees the bytes as sent). For each answer
// it checks that:
//
//   - CheckLeak finds nothing of the handle in what the client received;
//   - no engine request carries an Accept-Encoding, though the client's
//     does;
//   - an answer whose handle is removable (HostileAnswer.Clean) reaches
//     the client with 200 and exactly as Clean: the same bytes for a body,
//     the same events (read strictly and leniently) for a stream;
//   - a 2xx answer is decoded once: a failure that the same request would
//     bring again is not redone.
func TestHostile(t *testing.T, e *HostileEngine, url string, client *http.Client) {
	for _, path := range []string{PathChat, PathCompletions, PathResponses, PathMessages} {
		for _, stream := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s stream=%v", path, stream), func(t *testing.T) {
				for _, a := range HostileAnswers(path, stream) {
					t.Run(a.Name, func(t *testing.T) { hostileTurn(t, e, url, client, a) })
				}
			})
		}
	}
}

func hostileTurn(t *testing.T, e *HostileEngine, url string, client *http.Client, a HostileAnswer) {
	t.Helper()
	resp, body := sendHostile(t, e, url, client, a, a.Stream)
	if a.Clean == nil {
		return
	}
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status %d for a removable handle: %.600q", resp.StatusCode, body)
	}
	if !a.Stream {
		if !bytes.Equal(a.Clean, body) {
			t.Errorf("forwarded %q\nwant      %q", body, a.Clean)
		}
		return
	}
	for _, lenient := range []bool{false, true} {
		if got, want := ParseEvents(body, lenient), ParseEvents(a.Clean, lenient); !slices.EqualFunc(got, want, eventEqual) {
			t.Errorf("lenient %v: forwarded events %q\nwant %q", lenient, got, want)
		}
	}
}

func eventEqual(a, b Event) bool {
	return a.Name == b.Name && a.ID == b.ID && bytes.Equal(a.Data, b.Data)
}

// sendHostile has e answer a, sends the client's request for a.Path
// (streamed when stream is set, with an Accept-Encoding the router must
// not pass on) and checks what came back leaks nothing and took one decode
// leg when the engine answered 2xx.
func sendHostile(t *testing.T, e *HostileEngine, url string, client *http.Client, a HostileAnswer, stream bool) (*http.Response, []byte) {
	t.Helper()
	e.SetAnswer(a)
	before := e.DecodeLegs()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url+a.Path, strings.NewReader(hostileRequest(a.Path, stream)))
	if err != nil {
		t.Fatal(err)
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept-Encoding", "gzip, br, zstd, deflate")
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, err := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if err != nil {
		t.Fatalf("reading the answer: %v", err)
	}
	if err := CheckLeak(resp.Header, body, HostileSecrets()...); err != nil {
		t.Fatalf("%v\nstatus %d, engine answer %.300q\nforwarded %.600q", err, resp.StatusCode, a.Body, body)
	}
	if n := e.AcceptEncodings(); n > 0 {
		t.Errorf("%d engine requests carried an Accept-Encoding (the client sent one)", n)
	}
	if n := e.DecodeLegs() - before; a.Status/100 == 2 && n != 1 {
		t.Errorf("%d decode legs, want 1: a deterministic failure is not redone", n)
	}
	return resp, body
}
