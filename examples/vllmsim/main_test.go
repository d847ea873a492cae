package main

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"io"
	"net/http"
	"os"
	"os/exec"
	"regexp"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"go.uber.org/goleak"

	"github.com/bidikv/bidikv/internal/sim"
)

// childEnv makes the test binary run vllmsim instead of the tests, so the
// cross-process test needs no separate build.
const childEnv = "VLLMSIM_TEST_CHILD"

func TestMain(m *testing.M) {
	if os.Getenv(childEnv) == "1" {
		args := os.Args[1:]
		for i, a := range args {
			if a == "--" {
				args = args[i+1:]
				break
			}
		}
		main2(args)
		return
	}
	goleak.VerifyTestMain(m)
}

// main2 is main with explicit arguments.
func main2(args []string) {
	os.Args = append([]string{"vllmsim"}, args...)
	main()
	os.Exit(0)
}

// bidiKV is the --kv-transfer-config of an engine with bidirectional
// transfer (vLLM's defaults otherwise).
const bidiKV = `{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`

var ready = regexp.MustCompile(`serving (http://\S+) side channel (\S+) engine (\S+)`)

type proc struct {
	url, side, engine string
	line              string // the ready line
	cmd               *exec.Cmd
}

// spawn starts vllmsim in a child process on 127.0.0.1 and waits for its
// ready line.
func spawn(t *testing.T, args ...string) *proc {
	t.Helper()
	cmd := exec.Command(os.Args[0], append([]string{"--", "--port", "0", "--side-channel-port", "0"}, args...)...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	cmd.Stderr = os.Stderr
	require.NoError(t, cmd.Start())
	t.Cleanup(func() {
		_ = cmd.Process.Signal(os.Interrupt)
		_ = cmd.Wait()
	})
	line, err := bufio.NewReader(out).ReadString('\n')
	require.NoError(t, err, "vllmsim did not start")
	go func() { _, _ = io.Copy(io.Discard, out) }()
	m := ready.FindStringSubmatch(line)
	require.NotNil(t, m, line)
	return &proc{url: m[1], side: m[2], engine: m[3], line: line, cmd: cmd}
}

func call(t *testing.T, url string, body map[string]any) (string, json.RawMessage) {
	t.Helper()
	raw, err := json.Marshal(body)
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodPost, url+"/v1/chat/completions", bytes.NewReader(raw))
	resp, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	require.Equal(t, http.StatusOK, resp.StatusCode, string(b))
	var out struct {
		Choices []struct {
			Message struct{ Content string } `json:"message"`
		} `json:"choices"`
		KV json.RawMessage `json:"kv_transfer_params"`
	}
	require.NoError(t, json.Unmarshal(b, &out))
	return out.Choices[0].Message.Content, out.KV
}

func stats(t *testing.T, url string) sim.Stats {
	t.Helper()
	resp, err := http.Get(url + "/sim/stats")
	require.NoError(t, err)
	defer resp.Body.Close()
	var s sim.Stats
	require.NoError(t, json.NewDecoder(resp.Body).Decode(&s))
	return s
}

func reference(t *testing.T, body map[string]any) string {
	t.Helper()
	raw, _ := json.Marshal(body)
	req, err := sim.ParseRequest(sim.PathChat, raw)
	require.NoError(t, err)
	ids := make([]uint32, len(req.Prompt))
	for i, tk := range req.Prompt {
		ids[i] = tk.ID
	}
	return sim.Reference("sim-model", ids, sim.GenParams{}).Content
}

func messages(turns ...string) map[string]any {
	var msgs []any
	for i, c := range turns {
		role := "user"
		if i%2 == 1 {
			role = "assistant"
		}
		msgs = append(msgs, map[string]any{"role": role, "content": c})
	}
	return map[string]any{"model": "sim-model", "messages": msgs}
}

func withKV(body map[string]any, kv any, maxTokens int) map[string]any {
	out := map[string]any{}
	for k, v := range body {
		out[k] = v
	}
	out["kv_transfer_params"] = kv
	if maxTokens > 0 {
		out["max_tokens"] = maxTokens
	}
	return out
}

// Two vllmsim processes complete a hand-driven two-turn exchange: P→D, then
// D→P (P reads D's blocks through D's side channel) and P→D again.
func TestTwoProcessesTwoTurns(t *testing.T) {
	kvc := `{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true,"kv_recompute_threshold":64}}`
	p := spawn(t, "--kv-transfer-config", kvc, "--no-enable-prefix-caching")
	d := spawn(t, "--kv-transfer-config", kvc)
	assert.NotEqual(t, p.side, d.side)

	miss := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
	long := "the quick brown fox jumps over the lazy dog and keeps running through the forest until nightfall"
	turn1 := messages(long + " " + long + " " + long)
	_, ph := call(t, p.url, withKV(turn1, miss, 1))
	require.NotEqual(t, "null", string(ph))
	var h map[string]any
	require.NoError(t, json.Unmarshal(ph, &h))
	assert.Equal(t, p.engine, h["remote_engine_id"])

	reply, dh := call(t, d.url, withKV(turn1, json.RawMessage(ph), 0))
	assert.Equal(t, reference(t, turn1), reply)
	require.NotEqual(t, "null", string(dh))
	assert.Zero(t, stats(t, p.url).BlocksPinned, "D's notify freed P's blocks")

	var dm map[string]any
	require.NoError(t, json.Unmarshal(dh, &dm))
	dm["do_remote_decode"], dm["do_remote_prefill"] = true, false
	turn2 := messages(long+" "+long+" "+long, reply, "and then what happened to the fox after the night had fallen")
	_, ph2 := call(t, p.url, withKV(turn2, dm, 1))
	ps := stats(t, p.url)
	assert.Positive(t, ps.TokensPulledIn, "P read D's blocks across processes")
	assert.Equal(t, ps.TokensPulledIn, stats(t, d.url).TokensPulledOut)
	assert.Zero(t, stats(t, d.url).BlocksPinned, "P's notify freed D's blocks")

	reply2, _ := call(t, d.url, withKV(turn2, json.RawMessage(ph2), 0))
	assert.Equal(t, reference(t, turn2), reply2)
	assert.Zero(t, stats(t, d.url).WrongOutputs)
}

// vLLM's defaults across processes: engines whose --kv-transfer-config
// leaves out bidirectional_kv_xfer transfer P→D only (D answers without a
// handle and frees its blocks: no turn can be reused), and an
// engine started without --kv-transfer-config has no connector: it
// ignores kv_transfer_params and returns none.
func TestProcessKVTransferDefaults(t *testing.T) {
	kvc := `{"kv_connector":"NixlConnector","kv_role":"kv_both"}`
	p := spawn(t, "--kv-transfer-config", kvc, "--no-enable-prefix-caching")
	d := spawn(t, "--kv-transfer-config", kvc)
	miss := map[string]any{"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": nil,
		"remote_block_ids": nil, "remote_host": nil, "remote_port": nil}
	long := "the quick brown fox jumps over the lazy dog and keeps running through the forest until nightfall"
	turn1 := messages(long + " " + long + " " + long)
	_, ph := call(t, p.url, withKV(turn1, miss, 1))
	require.NotEqual(t, "null", string(ph), "P→D works without bidirectional_kv_xfer")
	reply, dh := call(t, d.url, withKV(turn1, json.RawMessage(ph), 0))
	assert.Equal(t, reference(t, turn1), reply)
	assert.Equal(t, "null", string(dh), "no D handle without bidirectional_kv_xfer")
	ds := stats(t, d.url)
	assert.Positive(t, ds.TokensPulledIn, "D read P's blocks")
	assert.Zero(t, ds.BlocksPinned, "D holds nothing")

	plain := spawn(t)
	_, h := call(t, plain.url, withKV(turn1, miss, 1))
	assert.Equal(t, "null", string(h), "no connector: no handle")
	ps := stats(t, plain.url)
	assert.Equal(t, 1, ps.PlainRequests, "served as a plain request")
	assert.Zero(t, ps.BlocksPinned)
}
