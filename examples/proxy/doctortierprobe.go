package main

import (
	"bytes"
	"cmp"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"strings"

	"github.com/bidikv/bidikv/kvroute/capability"
	"github.com/bidikv/bidikv/transport"
)

// The --probe --cpu-tier peer pull. The hash seed, the offloaded chunk
// size, offload_prompt_only and the peer port are not exported, so only a
// pull shows them right: a prompt no engine has seen goes to a decode
// engine twice (max_tokens 1, then enough tokens to seal generated
// chunks), then the prompt and the answer, as token ids, to a prefill
// engine with kv_transfer_params.remote_kv_source naming the decode
// engine's peer tier (vLLM PR 48021: tiering/p2p/manager.py,
// _parse_source). The engines' vllm:kv_offload_* byte counters, read
// before and after, tell what the decode engine stored of the prompt and
// of its answer and what the prefill engine loaded. Bytes turn into tokens
// at the decode engine's bytes per prompt token (what it stored of the
// prompt over the prompt's whole GPU blocks: exact when the offloaded
// chunk is one block, vLLM's default). The counters are the engines' own:
// other traffic during the probe blurs them.

// tierProbeBody bounds an answer the probe reads.
const tierProbeBody = 4 << 20

// tierPeer is the pair a pull is tried between.
type tierPeer struct {
	p, d   engineFacts
	host   string // the decode engine's peer-tier host ("": its URL's)
	port   int    // the decode engine's peer-tier port (rank 0)
	named  string // the flag that gave them
	key    string
	rt     http.RoundTripper
	engOpt []capability.Option
}

// tierProbe pulls once per decode engine, from a prefill engine (in turn).
func (o tierOptions) tierProbe(ctx context.Context, rt http.RoundTripper, c *config, engines []engineFacts) []tierCheck {
	var prefill, decode []engineFacts
	for _, e := range engines {
		switch {
		case e.rep == nil || !e.rep.Reachable:
		case e.role == rolePrefill:
			prefill = append(prefill, e)
		default:
			decode = append(decode, e)
		}
	}
	if len(prefill) == 0 || len(decode) == 0 {
		return []tierCheck{{check: "peer pull", severity: gapWarn,
			seen: "not run: it needs a reachable prefill engine and a reachable decode engine",
			fix:  "check the engines' addresses and that they are up"}}
	}
	var opts []capability.Option
	if c.upstreamAPIKey != "" {
		opts = append(opts, capability.WithAPIKey(c.upstreamAPIKey))
	}
	var out []tierCheck
	for i, d := range decode {
		tp := tierPeer{p: prefill[i%len(prefill)], d: d, port: o.port, named: "--cpu-tier-port", key: c.upstreamAPIKey, rt: rt, engOpt: opts}
		if hp, ok := o.peers.m[d.url]; ok { // checked by the flag
			h, port, _ := net.SplitHostPort(hp)
			tp.host, tp.named = h, "--cpu-tier-peers"
			tp.port, _ = strconv.Atoi(port)
		}
		out = append(out, tp.pull(ctx))
	}
	return out
}

// pull runs one seeded peer pull and says what it showed.
func (tp tierPeer) pull(ctx context.Context) tierCheck {
	pair := fmt.Sprintf("decode engine %s → prefill engine %s", tp.d.url, tp.p.url)
	notRun := func(why, fix string) tierCheck {
		return tierCheck{check: "peer pull", severity: gapWarn, seen: pair + ": not run: " + why, fix: fix}
	}
	for _, e := range []engineFacts{tp.d, tp.p} {
		if e.rep.KVOffload.Is(capability.Absent) {
			return notRun(fmt.Sprintf("the %s engine has no offloading connector (%s)", e.role, e.rep.KVOffload.Why), fixTierConnector(e.role))
		}
	}
	dep, err := transport.ParseEndpoint(tp.d.url)
	if err != nil {
		return notRun(err.Error(), "")
	}
	pep, err := transport.ParseEndpoint(tp.p.url)
	if err != nil {
		return notRun(err.Error(), "")
	}
	if tp.d.rep.DataParallel > 1 {
		dep.Rank = 0 // rank 0's tier, at the base port
	}
	bs := max(tp.d.rep.BlockSize, 16)
	nonce := fmt.Sprintf("%016x", rand.Uint64())

	d0, p0, err := tp.counters(ctx, dep, pep)
	if err != nil {
		return notRun(err.Error(), "check that /metrics answers on both engines")
	}
	// 1: the prompt alone: what D stores of it calibrates bytes per token.
	first, err := tp.complete(ctx, tp.d, dep, map[string]any{"prompt": tierPrompt(nonce, 8*bs), "max_tokens": 1})
	if err != nil {
		return notRun("the decode engine's first request: "+err.Error(), "")
	}
	if len(first.prompt) == 0 {
		return notRun("the decode engine returned no prompt_token_ids (return_token_ids is vLLM 0.10.2 and later): the pull needs the exact tokens",
			"a vLLM with return_token_ids on the completions API")
	}
	d1, _, err := tp.counters(ctx, dep, pep)
	if err != nil {
		return notRun(err.Error(), "")
	}
	// 2: the same prompt with enough tokens to seal generated chunks.
	gen := 4*bs + 1
	second, err := tp.complete(ctx, tp.d, dep, map[string]any{"prompt": first.prompt, "max_tokens": gen, "ignore_eos": true})
	if err != nil {
		return notRun("the decode engine's second request: "+err.Error(), "")
	}
	d2, _, err := tp.counters(ctx, dep, pep)
	if err != nil {
		return notRun(err.Error(), "")
	}
	storedPrompt, storedGen := d1.OffloadStoreBytes-d0.OffloadStoreBytes, d2.OffloadStoreBytes-d1.OffloadStoreBytes
	n := len(first.prompt)
	if storedPrompt <= 0 {
		return tierCheck{check: "peer pull", severity: gapWarn,
			seen: fmt.Sprintf("%s: the decode engine stored nothing in its CPU tier for a %d-token prompt (vllm:kv_offload_store_bytes unchanged), so there was nothing to pull: its connector is not the OffloadingConnector, its tier cannot make room (vllm:kv_offload_allocation_failure rising), store_threshold is above 0, or the offloaded block_size is above %d tokens", pair, n, n),
			fix:  fixTierConnector(roleDecode)}
	}
	// D stored the prompt's whole chunks: whole GPU blocks at least.
	perToken := storedPrompt / float64(max(n/bs*bs, 1))

	// 3: the prompt and the answer, pulled by the prefill engine.
	toks := append(append([]int64(nil), first.prompt...), second.answer...)
	host := cmp.Or(tp.host, dep.URL.Hostname())
	src := map[string]any{"kv_request_id": "bidikv-doctor-" + nonce, "remote_host": host, "remote_port": tp.port}
	if _, err := tp.complete(ctx, tp.p, pep, map[string]any{"prompt": toks, "max_tokens": 1,
		"kv_transfer_params": map[string]any{"remote_kv_source": src}}); err != nil {
		return notRun("the prefill engine's request: "+err.Error(), "")
	}
	_, p3, err := tp.counters(ctx, dep, pep)
	if err != nil {
		return notRun(err.Error(), "")
	}
	loaded := p3.OffloadLoadBytes - p0.OffloadLoadBytes
	tokens := func(b float64) int { return int(b/perToken + 0.5) }
	where := fmt.Sprintf("remote_kv_source %s", net.JoinHostPort(host, strconv.Itoa(tp.port)))
	switch {
	case loaded <= 0:
		return tierCheck{check: "peer pull", severity: gapWarn,
			seen: fmt.Sprintf("%s: every peer pull missed: the decode engine stored about %d of the %d tokens (prompt and answer) in its CPU tier, and the prefill engine loaded none of them through %s. The peer tier shows no error for this: the request computes", pair, tokens(storedPrompt+storedGen), n+len(second.answer), where),
			fix: "one PYTHONHASHSEED on every engine (required with xxhash and on older vLLM); one --prefix-caching-hash-algo; one --block-size and one offloaded block_size (the handshake rejects a mismatch: the engines log \"rejecting peer connect\"); " +
				fmt.Sprintf("the decode engine's peer tier at port %d (%s: its VLLM_P2P_SIDE_CHANNEL_PORT, rank k at +k) reachable from the prefill engine, ", tp.port, tp.named) +
				"with VLLM_P2P_SIDE_CHANNEL_HOST its routable address, not localhost, across hosts; a p2p secondary tier on the prefill engine too"}
	case loaded <= storedPrompt*1.001:
		seen := fmt.Sprintf("%s: the prefill engine loaded about %d of the %d prompt tokens through %s, none of the %d generated ones", pair, tokens(loaded), n, where, len(second.answer))
		if storedGen <= 0 {
			return tierCheck{check: "peer pull", severity: gapWarn,
				seen: seen + ": the decode engine stored none of its answer in its CPU tier (vllm:kv_offload_store_bytes unchanged while it generated), so a later turn's history cannot be pulled",
				fix:  `"offload_prompt_only": false in the decode engines' OffloadingConnector kv_connector_extra_config (vLLM's default, true, stores prompts only)`}
		}
		return tierCheck{check: "peer pull", severity: gapWarn,
			seen: seen + fmt.Sprintf(", though the decode engine stored about %d of them: the pull stopped at the first missing chunk", tokens(storedGen)),
			fix:  "a larger CPU tier on the engines (cpu_bytes_to_use), and no other traffic during the probe"}
	}
	return tierCheck{check: "peer pull", severity: tierOK,
		seen: fmt.Sprintf("%s: the prefill engine loaded about %d of the %d tokens of the prompt (%d) and the answer (%d) from the decode engine's CPU tier through %s (a partial last chunk is never stored)",
			pair, tokens(loaded), n+len(second.answer), n, len(second.answer), where)}
}

// tierPrompt is a prompt of about words words no engine has cached.
func tierPrompt(nonce string, words int) string {
	var b strings.Builder
	b.WriteString("bidikv doctor CPU tier probe " + nonce + ":")
	vocab := []string{"river", "stone", "lantern", "harbour", "meadow", "copper", "willow", "signal"}
	for i := range words {
		b.WriteString(" " + vocab[i%len(vocab)])
	}
	return b.String()
}

// completion is what the probe reads of a completions answer.
type completion struct {
	prompt, answer []int64
}

// complete sends engine e (at ep) a completions request (temperature 0,
// return_token_ids, e's model) with body's fields.
func (tp tierPeer) complete(ctx context.Context, e engineFacts, ep transport.Endpoint, body map[string]any) (completion, error) {
	body["temperature"] = 0
	body["return_token_ids"] = true
	if m := e.rep.Model; m != "" {
		body["model"] = m
	}
	raw, err := json.Marshal(body)
	if err != nil {
		return completion{}, err
	}
	req, err := ep.NewRequest(ctx, http.MethodPost, "/v1/completions", bytes.NewReader(raw))
	if err != nil {
		return completion{}, err
	}
	req.Header.Set("Content-Type", "application/json")
	if tp.key != "" {
		req.Header.Set("Authorization", "Bearer "+tp.key)
	}
	resp, err := (&http.Client{Transport: tp.rt}).Do(req)
	if err != nil {
		return completion{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(io.LimitReader(resp.Body, tierProbeBody))
	if err != nil {
		return completion{}, err
	}
	if resp.StatusCode != http.StatusOK {
		return completion{}, fmt.Errorf("POST /v1/completions: %d: %s", resp.StatusCode, clipAnswer(string(data)))
	}
	var ans struct {
		Choices []struct {
			TokenIDs       []int64 `json:"token_ids"`
			PromptTokenIDs []int64 `json:"prompt_token_ids"`
		} `json:"choices"`
	}
	if err := json.Unmarshal(data, &ans); err != nil || len(ans.Choices) == 0 {
		return completion{}, fmt.Errorf("POST /v1/completions: an answer without choices")
	}
	return completion{prompt: ans.Choices[0].PromptTokenIDs, answer: ans.Choices[0].TokenIDs}, nil
}

// counters reads both engines' /metrics.
func (tp tierPeer) counters(ctx context.Context, dep, pep transport.Endpoint) (d, p *capability.Report, err error) {
	d, _ = capability.Refresh(ctx, tp.rt, dep, tp.d.rep, tp.engOpt...)
	p, _ = capability.Refresh(ctx, tp.rt, pep, tp.p.rep, tp.engOpt...)
	for _, r := range []*capability.Report{d, p} {
		if !r.Metrics.Is(capability.Present) {
			return nil, nil, fmt.Errorf("%s: /metrics: %s", r.Endpoint, r.Metrics.Why)
		}
	}
	return d, p, nil
}
