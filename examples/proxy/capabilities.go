package main

import (
	"fmt"
	"slices"
	"strings"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
)

// engineFacts is one engine and what its last capability probe found.
type engineFacts struct {
	role, url string
	rep       *capability.Report // nil: not probed yet
	// status is what a router's turns showed of the engine (nil: no
	// router): its block size and whether it serves without reuse.
	status *kvroute.EndpointStatus
}

// Severities of a gap.
const (
	gapNote  = "note"  // something reuse depends on that the proxy cannot see yet
	gapWarn  = "warn"  // some turns cannot reuse, or reuse less than they could
	gapError = "error" // reuse cannot work at all
)

// gap is something the configuration asks of the engines found that they
// cannot do, what it costs, and the change that fixes it.
type gap struct {
	severity string
	what     string // names the flag or API and the engine
	fix      string
}

func (g gap) String() string {
	if g.fix == "" {
		return g.what
	}
	return g.what + "; fix: " + g.fix
}

// blocking reports whether a gap means reuse cannot work at all.
func blocking(gaps []gap) bool {
	return slices.ContainsFunc(gaps, func(g gap) bool { return g.severity == gapError })
}

// gaps compares the configuration with the engines found: the one place
// the proxy's start-up warnings and the doctor decide what cannot work.
// Engines not probed yet are left out.
func (c *config) gaps(engines []engineFacts) []gap {
	var out []gap
	add := func(severity, fix, format string, args ...any) {
		g := gap{severity: severity, what: fmt.Sprintf(format, args...), fix: fix}
		for _, have := range out {
			if have == g {
				return
			}
		}
		out = append(out, g)
	}
	var prefill, decode []engineFacts
	for _, e := range engines {
		switch {
		case e.rep == nil:
		case !e.rep.Reachable:
			add(gapWarn, "check the address and that the engine is up", "%s engine %s is unreachable (%s)", e.role, e.url, e.rep.Error)
		case e.role == rolePrefill:
			prefill = append(prefill, e)
		default:
			decode = append(decode, e)
		}
	}
	all := append(append([]engineFacts(nil), prefill...), decode...)
	for _, e := range all {
		if len(e.rep.Implausible) > 0 {
			add(gapWarn, "check the engine's metrics exporter and its host's clock",
				"%s engine %s: its /metrics reports values no real engine does (%s): they are ignored, and its last plausible ones kept",
				e.role, e.url, strings.Join(e.rep.Implausible, ", "))
		}
	}

	// What no turn can do without.
	for _, e := range all {
		if f := e.rep.Bidirectional; f.Is(capability.Absent) {
			add(gapError, f.Fix, "%s engine %s: %s: no turn can reuse KV", e.role, e.url, f.Why)
		}
	}
	if ps, ds := versions(prefill), versions(decode); len(ps)+len(ds) > 0 {
		if both := union(ps, ds); len(both) > 1 {
			add(gapError, "run the same vLLM version on every prefill and decode engine",
				"prefill engines run vLLM %s, decode engines %s: the NIXL handshake needs the same vLLM version and configuration on P and D",
				strings.Join(ps, ", "), strings.Join(ds, ", "))
		}
	}
	c.blockSizeGaps(all, add)

	// Verification by tokens: the prefill engines render.
	if c.verification == string(kvroute.VerifyTokens) {
		for _, e := range prefill {
			chat, chatF := e.rep.TokenPath(capability.Chat)
			agent, agentF := e.rep.TokenPath(capability.Responses)
			switch {
			case chat == capability.TokensNone && chatF.Is(capability.Absent):
				add(gapWarn, chatF.Fix,
					"--verification tokens: prefill engine %s serves neither the render routes (%s) nor /tokenize: chat and completions turns fall back to content rules, and Responses and Messages turns are never reused",
					e.url, e.rep.Render.Chat.Why)
			case chat == capability.TokensTokenize:
				add(gapWarn, chatF.Fix,
					"--verification tokens: prefill engine %s has no render routes (%s): Responses and Messages turns are never reused; chat and completions are verified through /tokenize, and fall back to content rules when they use tool_choice, documents, reasoning_effort or response_format",
					e.url, e.rep.Render.Chat.Why)
			case agent == capability.TokensNone && agentF.Is(capability.Absent):
				add(gapWarn, agentF.Fix, "--verification tokens: prefill engine %s: %s: Responses turns are never reused", e.url, agentF.Why)
			}
			if _, f := e.rep.TokenPath(capability.Messages); f.Is(capability.Absent) && agent != capability.TokensNone {
				add(gapWarn, f.Fix, "--verification tokens: prefill engine %s: %s: Messages turns are never reused", e.url, f.Why)
			}
		}
		for _, e := range decode {
			if f := e.rep.ReturnTokenIDs; f.Is(capability.Absent) {
				add(gapWarn, f.Fix, "--verification tokens: decode engine %s: %s: chat and completions turns are retained under content rules only", e.url, f.Why)
			}
		}
	} else {
		add(gapWarn, "--verification tokens (the default), with engines that serve the render routes",
			"--verification content: Responses and Messages turns are never reused (they have no content rules), and chat and completions turns only when the history is resent exactly")
	}

	// The agent APIs need kv_transfer_params on both engines: a prefill
	// engine without them answers with no handle, which fails the turn.
	for _, a := range []capability.API{capability.Responses, capability.Messages} {
		for _, e := range all {
			f := e.rep.Handles.Get(a)
			switch {
			case !f.Is(capability.Absent):
			case e.role == rolePrefill && !c.localFallback:
				add(gapWarn, f.Fix+", or --local-prefill-fallback (the decode engine then prefills such turns itself)",
					"prefill engine %s: %s: %s turns fail with 502 (the prefill engine returns no handle)", e.url, f.Why, apiTitle(a))
			default:
				add(gapWarn, f.Fix, "%s engine %s: %s: %s turns are never reused", e.role, e.url, f.Why, apiTitle(a))
			}
		}
	}

	// Streams: the decode engine must put its handle in the stream.
	for _, e := range decode {
		for _, a := range capability.APIs {
			f := e.rep.StreamHandles.Get(a)
			switch {
			case c.buffers(a) && !f.Is(capability.Present):
				add(gapNote, "--decode-stream engine (or buffered:API for fewer APIs) where a person watches the text appear", "--decode-stream buffered: streamed %s turns whose decode engine's streams carry no handle run their decode leg non-streaming and reach the client as the API's stream once complete: they reuse KV, and the first token arrives with the last", apiTitle(a))
			case a == capability.Messages && f.Is(capability.Absent):
				add(gapWarn, f.Fix, "streamed %s turns (Claude Code) are never reused: %s", apiTitle(a), f.Why)
			case f.Is(capability.Absent) && e.rep.Handles.Get(a).Is(capability.Present):
				add(gapWarn, f.Fix, "decode engine %s: streamed %s turns are never reused: %s", e.url, apiTitle(a), f.Why)
			case f.Is(capability.Unknown) && (a == capability.Chat || a == capability.Completions):
				add(gapNote, f.Fix, "streamed chat and completions turns are reused only when the decode engines put the handle on a stream's final chunk (vLLM PR #40186); stock vLLM does not; learned from the first streams (bidikv_stream_without_handle_total)")
			}
		}
	}

	// Decode memory management needs each decode engine's KV capacity.
	if c.memory.budget >= 0 && c.memory.capacity == 0 {
		for _, e := range decode {
			if e.rep.KVCacheTokens <= 0 {
				add(gapWarn, "--decode-kv-capacity <the engine's KV capacity in tokens>, or run the engine with vllm:cache_config_info on /metrics (no --disable-log-stats)",
					"decode engine %s: KV capacity unknown (%s): decode memory management is off for it: its holds are kept for --retention-ttl, none released for memory", e.url, e.rep.Metrics.Why)
			}
		}
	}

	// Decode-local turns compute on the decode engine from its prefix cache.
	if c.decodeLocal {
		for _, e := range decode {
			if f := e.rep.PrefixCaching; f.Is(capability.Absent) {
				add(gapWarn, f.Fix+", or drop --decode-local",
					"--decode-local: decode engine %s runs without prefix caching (%s): a decode-local turn would recompute the whole prompt there", e.url, f.Why)
			}
		}
	}
	return out
}

// blockSizeGaps adds the gaps of the engines' block sizes. The router
// reads each engine's from its /metrics and checks its handles at it;
// --block-size stands in for an engine that reports none, and yields to
// one that reports another. An engine whose handles did not fit its size
// serves without reuse (learned from turns: st).
func (c *config) blockSizeGaps(engines []engineFacts, add func(severity, fix, format string, args ...any)) {
	if bs := blockSizes(engines); len(bs) > 1 {
		add(gapNote, "the same --block-size on every engine, unless the engines' vLLM transfers between block sizes",
			"the engines report different block sizes (%s): each engine's handles are checked at its own, and the transfers between them need vLLM's support for different block sizes on P and D", strings.Join(bs, ", "))
	}
	for _, e := range engines {
		switch b := e.rep.BlockSize; {
		case b > 0 && c.blockSize > 0 && b != c.blockSize:
			add(gapWarn, "--block-size 0 (the default: each engine's own, read from its /metrics)",
				"--block-size %d, but %s engine %s reports block_size %d: its own is used for its handles",
				c.blockSize, e.role, e.url, b)
		case b == 0 && c.blockSize == 0:
			add(gapNote, "run the engine without --disable-log-stats (vllm:cache_config_info), or give its --block-size to --block-size",
				"%s engine %s reports no block size (no vllm:cache_config_info on /metrics): its handles' block counts are not checked and none is reused in part", e.role, e.url)
		}
		if e.status != nil && e.status.NoReuse != "" {
			fix := "give the engine's --block-size to --block-size"
			if e.status.BlockSizeSource == "engine" {
				fix = "check the engine: its handles do not follow the block size its /metrics report"
			}
			add(gapWarn, fix, "%s engine %s serves without reuse: its handles do not fit block size %d (%s)",
				e.role, e.url, e.status.BlockSize, e.status.NoReuse)
		}
	}
}

// apiTitle names an API as the docs do.
func apiTitle(a capability.API) string {
	switch a {
	case capability.Chat:
		return "chat"
	case capability.Completions:
		return "completions"
	case capability.Responses:
		return "Responses"
	}
	return "Messages"
}

// versions lists the vLLM versions the engines report, sorted, once each.
func versions(es []engineFacts) []string {
	var out []string
	for _, e := range es {
		if v := e.rep.VLLMVersion; v != "" && !slices.Contains(out, v) {
			out = append(out, v)
		}
	}
	slices.Sort(out)
	return out
}

// blockSizes lists the engines' block sizes as "16 (url)", once per size.
func blockSizes(es []engineFacts) []string {
	seen := map[int]bool{}
	var out []string
	for _, e := range es {
		if b := e.rep.BlockSize; b > 0 && !seen[b] {
			seen[b] = true
			out = append(out, fmt.Sprintf("%d on %s", b, e.url))
		}
	}
	return out
}

func union(a, b []string) []string {
	out := append([]string(nil), a...)
	for _, s := range b {
		if !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out
}

// apiView is what the engines found allow on one API.
type apiView struct {
	api capability.API
	// verification is how a turn's reuse is proven: "render", "/tokenize",
	// "content rules", or "none".
	verification string
	verifyState  capability.State
	// handles: kv_transfer_params on every prefill and decode engine;
	// streams: a handle in every decode engine's streams.
	handles, streams capability.State
	// reuse and streamed: whether a non-streaming and a streaming turn can
	// reuse KV.
	reuse, streamed capability.State
	// buffered: --decode-stream buffered covers the API's streams.
	buffered bool
	// why and fix explain the first gap of reuse, then of streamed.
	why, fix string
}

// worst orders states Absent < Unknown < Present.
func worst(a, b capability.State) capability.State {
	rank := map[capability.State]int{capability.Absent: 0, capability.Unknown: 1, capability.Present: 2, "": 1}
	if rank[b] < rank[a] {
		return b
	}
	return a
}

// views assesses each API over the engines found (those not probed, or
// unreachable, are left out).
func (c *config) views(engines []engineFacts) []apiView {
	var prefill, decode []*capability.Report
	bidirectional := capability.Present
	var biFact capability.Fact
	for _, e := range engines {
		if e.rep == nil || !e.rep.Reachable {
			continue
		}
		if e.role == rolePrefill {
			prefill = append(prefill, e.rep)
		} else {
			decode = append(decode, e.rep)
		}
		if f := e.rep.Bidirectional; f.Is(capability.Absent) {
			bidirectional, biFact = capability.Absent, f
		}
	}
	out := make([]apiView, 0, len(capability.APIs))
	for _, a := range capability.APIs {
		v := apiView{api: a, handles: capability.Present, streams: capability.Present, verifyState: capability.Present}
		if len(prefill) == 0 || len(decode) == 0 {
			v.handles, v.streams, v.verifyState = capability.Unknown, capability.Unknown, capability.Unknown
		}
		gap := func(s capability.State, f capability.Fact) {
			if s != capability.Present && v.why == "" && (s == capability.Absent || f.Why != "") {
				v.why, v.fix = f.Why, f.Fix
			}
		}
		// Verification.
		agent := a == capability.Responses || a == capability.Messages
		switch {
		case c.verification != string(kvroute.VerifyTokens) && agent:
			v.verification, v.verifyState = "none", capability.Absent
			gap(capability.Absent, capability.Fact{Why: "--verification content: " + apiTitle(a) + " has no content rules",
				Fix: "--verification tokens (the default), with engines that serve the render routes"})
		case c.verification != string(kvroute.VerifyTokens):
			v.verification = "content rules"
		default:
			v.verification = "render"
			for _, p := range prefill {
				path, f := p.TokenPath(a)
				switch {
				case path == capability.TokensTokenize && v.verification == "render":
					v.verification = "/tokenize"
				case path == capability.TokensNone && !agent:
					v.verification = "content rules"
					gap(capability.Unknown, capability.Fact{Why: "no token source (" + f.Why + "): content rules", Fix: f.Fix})
				case path == capability.TokensNone:
					v.verification, v.verifyState = "none", worst(v.verifyState, f.State)
					gap(f.State, f)
				}
			}
		}
		// Handles in bodies and streams.
		for _, r := range append(append([]*capability.Report(nil), prefill...), decode...) {
			f := r.Handles.Get(a)
			v.handles = worst(v.handles, f.State)
			gap(f.State, f)
		}
		for _, r := range decode {
			v.streams = worst(v.streams, r.StreamHandles.Get(a).State)
		}
		v.reuse = worst(worst(v.verifyState, v.handles), bidirectional)
		if bidirectional == capability.Absent {
			gap(capability.Absent, biFact)
		}
		v.streamed = worst(v.reuse, v.streams)
		if v.buffered = c.buffers(a); v.buffered {
			// Buffered streams carry the handle in the answer's body.
			v.streamed = v.reuse
		}
		if v.why == "" && !c.buffers(a) {
			for _, r := range decode {
				if f := r.StreamHandles.Get(a); !f.Is(capability.Present) {
					v.why, v.fix = "streams: "+f.Why, f.Fix
					break
				}
			}
		}
		out = append(out, v)
	}
	return out
}
