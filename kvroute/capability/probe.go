package capability

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/metricspage"
	"github.com/bidikv/bidikv/kvroute/internal/upstream"
	"github.com/bidikv/bidikv/transport"
)

// UserAgent names the probe's requests to the engines (their access logs
// show it), apart from the turns a router sends.
const UserAgent = "bidikv-capability-probe"

// DefaultTimeout bounds one Probe, all its requests together, when the
// caller's context has no earlier deadline.
const DefaultTimeout = 5 * time.Second

// Bounds of what a probe reads of an answer.
const (
	maxAnswer  = 64 << 10 // every answer but /metrics
	maxMetrics = 8 << 20  // vLLM's /metrics with its histograms is a few hundred KiB
)

// Option configures Probe.
type Option interface{ apply(*config) }

type optionFunc func(*config)

func (f optionFunc) apply(c *config) { f(c) }

type config struct {
	timeout time.Duration
	apiKey  string
	model   string
	now     func() time.Time
}

// WithTimeout bounds the whole probe (default DefaultTimeout; zero or
// negative means the default). A deadline of the caller's context that
// comes earlier wins.
func WithTimeout(d time.Duration) Option {
	return optionFunc(func(c *config) {
		if d > 0 {
			c.timeout = d
		}
	})
}

// WithAPIKey sends key as Authorization: Bearer (vLLM's --api-key);
// default none.
func WithAPIKey(key string) Option { return optionFunc(func(c *config) { c.apiKey = key }) }

// WithModel names the model in probe requests; default the first model of
// GET /v1/models, or none (vLLM then takes its served model).
func WithModel(name string) Option { return optionFunc(func(c *config) { c.model = name }) }

// WithClock sets the clock that stamps Report.ProbedAt (default time.Now).
func WithClock(now func() time.Time) Option {
	return optionFunc(func(c *config) {
		if now != nil {
			c.now = now
		}
	})
}

// Probe asks the engine at ep (pinned to its data-parallel rank, if any)
// what it offers, through rt, within the context and the probe's timeout,
// and returns the facts. It never fails: what it could not learn is
// Unknown, and an engine that never answered is not Reachable. Probe
// sends GET /version, /v1/models and /metrics, then POST /tokenize and the
// four render routes with a one-word prompt (a few hundred bytes each;
// answers are read up to 64 KiB, /metrics up to 8 MiB). It is safe for
// concurrent use.
func Probe(ctx context.Context, rt http.RoundTripper, ep transport.Endpoint, opts ...Option) *Report {
	cfg := config{timeout: DefaultTimeout, now: time.Now}
	for _, o := range opts {
		o.apply(&cfg)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	p := newProber(rt, ep, cfg)
	r := &Report{Endpoint: ep.String(), ProbedAt: cfg.now()}

	// Phase 1: what the engine is.
	var wg sync.WaitGroup
	var version, models, metrics answer
	wg.Go(func() { version = p.do(ctx, http.MethodGet, "/version", nil, maxAnswer) })
	wg.Go(func() { models = p.do(ctx, http.MethodGet, "/v1/models", nil, maxAnswer) })
	wg.Go(func() { metrics = p.do(ctx, http.MethodGet, "/metrics", nil, maxMetrics) })
	wg.Wait()
	r.readVersion(version)
	r.readModels(models)
	r.readMetrics(metrics)
	model := cfg.model
	if model == "" {
		model = r.Model
	}

	// Phase 2: what it renders.
	var renders [4]answer
	var tokenize answer
	for i, a := range APIs {
		wg.Go(func() { renders[i] = p.do(ctx, http.MethodPost, a.RenderPath(), renderBody(a, model), maxAnswer) })
	}
	wg.Go(func() { tokenize = p.do(ctx, http.MethodPost, "/tokenize", tokenizeBody(model), maxAnswer) })
	wg.Wait()
	v, hasVersion := ParseVersion(r.VLLMVersion)
	for i, a := range APIs {
		r.Render.Set(a, readRender(a, renders[i], v, hasVersion))
	}
	r.Tokenize = readTokenize(tokenize)

	for _, a := range []answer{version, models, metrics, tokenize, renders[0], renders[1], renders[2], renders[3]} {
		if a.status != 0 {
			r.Reachable = true
		} else if r.Error == "" && a.err != nil {
			r.Error = a.err.Error()
		}
	}
	if r.Reachable {
		r.Error = ""
	}
	r.byVersion(v, hasVersion)
	return r
}

// Refresh brings prev, an earlier report of the same engine, up to date at
// the cost of one request: it reads GET /metrics and returns a copy of
// prev with the facts /metrics gives (prefix caching, the KV pool) renewed
// and everything else, what was learned (Learn) included, kept. It probes
// in full instead (Probe; full is true) when prev is nil, was not
// reachable or could not tell the engine's version or render routes, when
// /metrics does not answer 200, or when its process_start_time_seconds
// differs from prev's: a restarted engine may run another version or
// configuration, and what was learned of the old process is dropped.
func Refresh(ctx context.Context, rt http.RoundTripper, ep transport.Endpoint, prev *Report, opts ...Option) (r *Report, full bool) {
	if prev == nil || !prev.Reachable || prev.Version.Is(Unknown) || prev.ProcessStart.IsZero() {
		return Probe(ctx, rt, ep, opts...), true
	}
	for _, a := range APIs {
		if prev.Render.Get(a).Is(Unknown) {
			return Probe(ctx, rt, ep, opts...), true
		}
	}
	cfg := config{timeout: DefaultTimeout, now: time.Now}
	for _, o := range opts {
		o.apply(&cfg)
	}
	mctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	ans := newProber(rt, ep, cfg).do(mctx, http.MethodGet, "/metrics", nil, maxMetrics)
	cancel()
	if ans.status != http.StatusOK {
		return Probe(ctx, rt, ep, opts...), true
	}
	next := *prev
	next.ProbedAt = cfg.now()
	next.readMetrics(ans)
	if !next.ProcessStart.Equal(prev.ProcessStart) {
		return Probe(ctx, rt, ep, opts...), true
	}
	return &next, false
}

// prober sends the probe's requests, through the engine client kvroute
// sends its own with (package upstream).
type prober struct {
	client *upstream.Client
	ep     transport.Endpoint
}

func newProber(rt http.RoundTripper, ep transport.Endpoint, cfg config) *prober {
	return &prober{client: upstream.New(transport.NewClient(rt), cfg.apiKey, cfg.now), ep: ep}
}

// answer is one request's outcome: a status and at most the bounded body,
// or the error that prevented an answer.
type answer struct {
	what   string // "GET /version"
	status int
	body   []byte
	err    error
}

func (a answer) String() string {
	if a.status == 0 {
		return a.what + ": " + errText(a.err)
	}
	return a.what + ": " + strconv.Itoa(a.status)
}

func errText(err error) string {
	switch {
	case err == nil:
		return "no answer"
	case errors.Is(err, context.DeadlineExceeded):
		return "no answer within the probe's deadline"
	case errors.Is(err, context.Canceled):
		return "probe cancelled"
	}
	return err.Error()
}

// do sends one request and returns the answer, whatever its status: an
// answer other than 2xx keeps its body as the client drained it (at most
// upstream.MaxErrorBody, as much as maxAnswer).
func (p *prober) do(ctx context.Context, method, path string, body []byte, limit int64) answer {
	a := answer{what: method + " " + path}
	status, err := p.client.Call(ctx, p.ep, upstream.Call{Method: method, Path: path, Body: body, UserAgent: UserAgent, Identity: true, Limit: limit},
		func(r io.Reader) (err error) {
			a.body, err = io.ReadAll(r)
			return err
		})
	a.status = status
	var se *upstream.StatusError
	switch {
	case errors.As(err, &se):
		a.body = se.Body
	case err != nil && ctx.Err() != nil:
		a.err = ctx.Err()
	case err != nil && status == 0:
		var ue *url.Error
		if errors.As(err, &ue) {
			err = ue.Err // the cause, as the RoundTripper gave it
		}
		a.err = err
	}
	return a
}

// renderBody is a minimal valid request of API a: one short user turn.
func renderBody(a API, model string) []byte {
	m := map[string]any{}
	if model != "" {
		m["model"] = model
	}
	switch a {
	case Chat:
		m["messages"] = []map[string]string{{"role": "user", "content": "hi"}}
	case Completions:
		m["prompt"] = "hi"
	case Responses:
		m["input"] = "hi"
	case Messages:
		m["max_tokens"] = 1
		m["messages"] = []map[string]string{{"role": "user", "content": "hi"}}
	}
	b, _ := json.Marshal(m)
	return b
}

func tokenizeBody(model string) []byte {
	m := map[string]any{"prompt": "hi"}
	if model != "" {
		m["model"] = model
	}
	b, _ := json.Marshal(m)
	return b
}

// errorMessage returns the message of an error body in OpenAI's,
// Anthropic's or FastAPI's shape, "" when there is none.
func errorMessage(body []byte) string {
	var e struct {
		Error  json.RawMessage `json:"error"`
		Detail json.RawMessage `json:"detail"`
	}
	if json.Unmarshal(body, &e) != nil {
		return ""
	}
	var inner struct {
		Message string `json:"message"`
	}
	if len(e.Error) > 0 && json.Unmarshal(e.Error, &inner) == nil && inner.Message != "" {
		return inner.Message
	}
	var s string
	if json.Unmarshal(e.Detail, &s) == nil {
		return s
	}
	return ""
}

// routeMissing reports a 404 for a route the server does not have
// (FastAPI's {"detail":"Not Found"}, or no JSON error at all), not a 404
// an endpoint answered (a model that does not exist, in OpenAI's shape).
func routeMissing(a answer) bool {
	if a.status != http.StatusNotFound {
		return false
	}
	var e struct {
		Error json.RawMessage `json:"error"`
	}
	return json.Unmarshal(a.body, &e) != nil || len(e.Error) == 0
}

// otherStatus is the Unknown of an answer the probe does not interpret.
func otherStatus(a answer) Fact {
	why := a.String()
	if msg := errorMessage(a.body); msg != "" {
		why += " " + quote(msg)
	}
	switch a.status {
	case http.StatusUnauthorized, http.StatusForbidden:
		why += " (the engine wants an API key: OPENAI_API_KEY)"
	}
	return unknown(why)
}

// quote bounds and quotes an engine's message for a Why.
func quote(s string) string {
	if len(s) > 160 {
		s = s[:160] + "…"
	}
	return strconv.Quote(s)
}

func (r *Report) readVersion(a answer) {
	switch {
	case a.status == http.StatusOK:
		var v struct {
			Version string `json:"version"`
		}
		if json.Unmarshal(a.body, &v) != nil || v.Version == "" {
			r.Version = unknown(a.String() + " without a version")
			return
		}
		r.VLLMVersion = v.Version
		r.Version = present(a.what + ": " + v.Version)
	case routeMissing(a):
		r.Version = absent(a.String()+" (not vLLM's OpenAI server?)", "")
	default:
		r.Version = otherStatus(a)
	}
}

func (r *Report) readModels(a answer) {
	if a.status != http.StatusOK {
		return
	}
	if m, ok := parseModels(a.body); ok {
		r.Model, r.MaxModelLen = m.Data[0].ID, m.Data[0].MaxModelLen
	}
}

// models is vLLM's GET /v1/models answer (ModelList of ModelCard).
type models struct {
	Data []struct {
		ID          string `json:"id"`
		MaxModelLen int    `json:"max_model_len"`
	} `json:"data"`
}

// parseModels reads a GET /v1/models answer that lists a model.
func parseModels(body []byte) (models, bool) {
	var m models
	return m, json.Unmarshal(body, &m) == nil && len(m.Data) > 0
}

// MaxModelLen reads a GET /v1/models answer: the largest max_model_len of
// the models it lists (vLLM lists the served model and its LoRA adapters,
// all of the engine's --max-model-len: the most tokens a request may
// take, prompt and max_tokens together), and false when none names one.
func MaxModelLen(body []byte) (int, bool) {
	m, ok := parseModels(body)
	if !ok {
		return 0, false
	}
	n := 0
	for _, d := range m.Data {
		n = max(n, d.MaxModelLen)
	}
	return n, n > 0
}

func (r *Report) readMetrics(a answer) {
	switch {
	case a.status == http.StatusOK:
	case routeMissing(a):
		r.Metrics = absent(a.String(), "")
		r.PrefixCaching, r.KVOffload = unknown(a.String()), unknown(a.String())
		return
	default:
		r.Metrics = otherStatus(a)
		r.PrefixCaching, r.KVOffload = unknown(r.Metrics.Why), unknown(r.Metrics.Why)
		return
	}
	m := metricspage.Parse(bytes.NewReader(a.body), -1, r.ProbedAt)
	r.Implausible = m.Absurd
	r.OffloadStoreBytes, r.OffloadLoadBytes = m.StoreBytes, m.LoadBytes
	if m.Offload {
		r.KVOffload = present(a.what + ": vllm:kv_offload_* series (an offloading connector)")
	} else {
		r.KVOffload = absent(a.what+": no vllm:kv_offload_* series (no offloading connector)", "")
	}
	if !m.Start.IsZero() || len(m.Absurd) == 0 {
		r.ProcessStart = m.Start // else the last plausible one (Refresh) stays
		if !m.Start.IsZero() {
			r.ProcessStart = m.Start.UTC()
		}
	}
	note := ""
	if len(m.Absurd) > 0 {
		note = " (implausible values ignored: " + strings.Join(m.Absurd, ", ") + ")"
	}
	c, cacheInfo := m.First()
	if !cacheInfo {
		if r.BlockSize > 0 && len(m.Absurd) > 0 {
			// Refresh: the configuration read before stands.
			r.Metrics = present(a.what + ": vllm:cache_config_info" + note)
			return
		}
		r.Metrics = absent(a.what+": no vllm:cache_config_info"+note, "")
		r.PrefixCaching = unknown(r.Metrics.Why)
		return
	}
	r.Metrics = present(a.what + ": vllm:cache_config_info" + note)
	// The block size the engine's handles follow, its first rank's.
	r.BlockSize, r.NumGPUBlocks, r.KVCacheTokens, r.DataParallel = c.Size, c.GPUBlocks, c.KVTokens, len(m.Caches)
	r.HashAlgo = c.HashAlgo
	if r.KVCacheTokens == 0 && r.BlockSize > 0 && r.NumGPUBlocks > 1 {
		r.KVCacheTokens = int64(r.NumGPUBlocks-1) * int64(r.BlockSize) // num_gpu_blocks counts the null block
	}
	switch c.PrefixCaching {
	case "True":
		r.PrefixCaching = present("vllm:cache_config_info enable_prefix_caching=True")
	case "False":
		r.PrefixCaching = absent("vllm:cache_config_info enable_prefix_caching=False",
			"start the engine without --no-enable-prefix-caching")
	default:
		r.PrefixCaching = unknown("vllm:cache_config_info without enable_prefix_caching")
	}
}

// Fixes of the render routes' gaps.
const (
	// FixScaleOut gives an engine its render routes (404 without it).
	FixScaleOut = "start the engine with `vllm serve ... --enable-scale-out` (vLLM 0.30 and later; " +
		"nightlies between PRs #54579 and #55176: VLLM_ENABLE_SCALE_OUT_ENDPOINTS=1)"
	// FixRenderer gives a render route that answers 501 a renderer.
	FixRenderer = "a vLLM build whose renderer serves this API (the route answers 501: NotImplementedError)"
)

// readRender interprets a render route's answer.
func readRender(a API, ans answer, v Version, hasVersion bool) Fact {
	switch {
	case ans.status == http.StatusOK:
		if !renderedTokens(a, ans.body) {
			return unknown(ans.String() + " without token_ids")
		}
		return present(ans.String())
	case routeMissing(ans):
		why := ans.String() + ": route not registered"
		switch {
		case !hasVersion || v.Has(SinceScaleOutFlag) != Absent:
			why += " (vllm serve without --enable-scale-out)"
		default:
			why += " (gated by VLLM_ENABLE_SCALE_OUT_ENDPOINTS on nightlies after PR #54579, or an engine older than the render API)"
		}
		return absent(why, FixScaleOut)
	case ans.status == http.StatusNotImplemented:
		why := ans.String() + ": no renderer for this API"
		if msg := errorMessage(ans.body); msg != "" {
			why += " " + quote(msg)
		}
		return absent(why, FixRenderer)
	}
	return otherStatus(ans)
}

// renderedTokens reports a render answer with token_ids: one
// GenerateRequest, or a list of them for completions.
func renderedTokens(a API, body []byte) bool {
	type gen struct {
		TokenIDs json.RawMessage `json:"token_ids"`
	}
	var one gen
	if a == Completions {
		var list []gen
		if json.Unmarshal(body, &list) == nil && len(list) > 0 {
			one = list[0]
		} else if json.Unmarshal(body, &one) != nil {
			return false
		}
	} else if json.Unmarshal(body, &one) != nil {
		return false
	}
	return bytes.HasPrefix(bytes.TrimSpace(one.TokenIDs), []byte("["))
}

func readTokenize(a answer) Fact {
	switch {
	case a.status == http.StatusOK:
		var t struct {
			Tokens json.RawMessage `json:"tokens"`
		}
		if json.Unmarshal(a.body, &t) != nil || !bytes.HasPrefix(bytes.TrimSpace(t.Tokens), []byte("[")) {
			return unknown(a.String() + " without tokens")
		}
		return present(a.String())
	case routeMissing(a):
		return absent(a.String()+": route not registered", "an engine that serves POST /tokenize (vLLM's API server with its tokenizer)")
	}
	return otherStatus(a)
}

// KVTransferPrefill and KVTransferDecode are the --kv-transfer-config of
// the prefill and of the decode engines for bidirectional reuse:
// NixlConnector (pull mode) with bidirectional_kv_xfer on both
// (docs/engines.md). NixlConnector takes each request's role from its
// kv_transfer_params, not from kv_role, but vLLM's scheduler defers
// freeing blocks under async scheduling (its default) or pipeline
// parallelism only on a KV consumer, kv_consumer or kv_both
// (vllm/v1/core/sched/scheduler.py, Scheduler.__init__, vLLM PR #45357).
// With bidirectional transfer the prefill engine loads KV too (the decode
// engine's blocks), so it keeps kv_both, for which vLLM logs a deprecation
// warning (nixl/connector.py, NixlBaseConnector.__init__); the decode
// engine takes kv_consumer.
const (
	// KVTransferPrefill is every prefill engine's --kv-transfer-config.
	KVTransferPrefill = `{"kv_connector":"NixlConnector","kv_role":"kv_both","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`
	// KVTransferDecode is every decode engine's --kv-transfer-config.
	KVTransferDecode = `{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_connector_extra_config":{"bidirectional_kv_xfer":true}}`
)

// Fixes of the gaps a version rule finds.
const (
	// FixBidirectional is the engine configuration bidirectional reuse needs.
	FixBidirectional = `--kv-transfer-config '` + KVTransferPrefill + `' on every prefill engine and '` +
		KVTransferDecode + `' on every decode engine, vLLM 0.21.0 or later, the same version on all (docs/engines.md)`
	// FixStreamHandles gives chat and completions streams a decode handle.
	FixStreamHandles = "apply vLLM PR #40186 on the decode engines (the handle on a stream's final chunk), " +
		"or run the proxy with --decode-stream buffered"
	// FixMessagesStreams: vLLM's Messages streams never carry a handle.
	FixMessagesStreams = "--decode-stream buffered (the decode leg runs non-streaming), or non-streaming Messages requests"
)

// byVersion sets what follows from the engine's version.
func (r *Report) byVersion(v Version, ok bool) {
	rule := func(since Version, what, pr string) Fact {
		if !ok {
			return unknown(what + ": version unknown (" + r.Version.or("no GET /version") + ")")
		}
		name := "vLLM " + r.VLLMVersion
		switch v.Has(since) {
		case Present:
			return present(fmt.Sprintf("%s has %s (%s, v%d.%d.%d)", name, what, pr, since.Major, since.Minor, since.Patch))
		case Absent:
			return absent(fmt.Sprintf("%s predates %s (%s, v%d.%d.%d)", name, what, pr, since.Major, since.Minor, since.Patch),
				fmt.Sprintf("upgrade vLLM to %d.%d.%d or later", since.Major, since.Minor, since.Patch))
		}
		return unknown(fmt.Sprintf("%s is a pre-release of the version that brought %s (%s)", name, what, pr))
	}
	r.ReturnTokenIDs = rule(SinceReturnTokenIDs, "return_token_ids", "PR #22587")
	for _, a := range []API{Chat, Completions} {
		if ok {
			r.Handles.Set(a, present("vLLM returns kv_transfer_params in "+string(a)+" bodies (with a KV connector)"))
		} else {
			r.Handles.Set(a, unknown("version unknown"))
		}
	}
	r.Handles.Responses = rule(SinceAgentKV, "kv_transfer_params on /v1/responses", "PR #37424")
	r.Handles.Messages = rule(SinceAgentKV, "kv_transfer_params on /v1/messages", "PR #37535")

	streams := unknown("not observable by a probe: stock vLLM sends no handle in " +
		"streams (PR #40186 unmerged); learned from the first streams")
	streams.Fix = FixStreamHandles
	r.StreamHandles.Chat, r.StreamHandles.Completions = streams, streams
	switch resp := r.Handles.Responses; resp.State {
	case Present:
		r.StreamHandles.Responses = present("response.completed carries the response's kv_transfer_params (PR #37424)")
	default:
		r.StreamHandles.Responses = Fact{State: resp.State, Why: resp.Why, Fix: resp.Fix}
	}
	r.StreamHandles.Messages = absent("vLLM's Messages streams carry no kv_transfer_params", FixMessagesStreams)

	switch bi := rule(SinceBidirectional, "bidirectional_kv_xfer", "PR #32553"); bi.State {
	case Absent:
		r.Bidirectional = bi
	default:
		r.Bidirectional = Fact{State: Unknown,
			Why: "not observable by a probe (needs bidirectional_kv_xfer in --kv-transfer-config); learned from turns",
			Fix: FixBidirectional}
	}
	if strings.TrimSpace(r.VLLMVersion) == "" && r.Version.State == "" {
		r.Version = unknown("GET /version: no answer")
	}
}
