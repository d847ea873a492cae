package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/bidikv/bidikv/kvroute"
)

// noteMeanings says what each reason a --probe note names means: why a
// turn's handle was not retained (kvroute.TurnRecord.StoreRefusal) or why
// a later turn reused nothing (TurnRecord.MissReason). The doctor prints
// the meaning of every reason its notes name, under the probe's table.
var noteMeanings = map[string]string{
	// why a turn was not retained
	string(kvroute.RefuseNoStreamHandle):     "the decode engine's stream ended without a handle (stock vLLM; PR #40186 puts one on the final chunk): the turn is not retained and the next one misses; --decode-stream buffered retains it",
	string(kvroute.RefuseNoHandle):           "the decode engine answered without a handle: bidirectional_kv_xfer is off on it, or the API carries no kv_transfer_params on that vLLM",
	string(kvroute.RefuseUnrendered):         "the prefill engine could not render the prompt (no render route: vllm serve without --enable-scale-out); vLLM returns no token ids on this API, so the turn cannot be verified by tokens and is not retained",
	string(kvroute.RefuseTokenOnly):          "Responses and Messages turns are kept only with a token fingerprint, which needs the prompt rendered by the prefill engine (vLLM returns no token ids there); it could not be rendered, so the turn is not retained",
	string(kvroute.RefuseRenderPending):      "the render of the prompt had not answered when the turn ended; the turn is retained when it answers",
	string(kvroute.RefuseReuseOff):           "reuse is off (--reuse=false)",
	string(kvroute.RefuseDecodeLocal):        "the turn ran on the decode engine as a plain request (--decode-local): it returns no handle, and the conversation's earlier handle stays retained",
	string(kvroute.RefuseUnusableHandle):     "the decode engine's handle lacks what vLLM needs to act on it (remote_engine_id, remote_request_id, remote_host, remote_port, block ids)",
	string(kvroute.RefuseInvalidHandle):      "the decode engine's handle holds a value vLLM would misread (a block list that does not fit --block-size, say); it is never sent to a prefill engine",
	string(kvroute.RefusePushHandle):         "the handle is of push mode (transfer_mode push), which bidirectional transfer cannot use: run NixlConnector in pull mode",
	string(kvroute.RefuseHandleTooLarge):     "the handle is larger than the store takes",
	string(kvroute.RefuseIdentifierError):    "the conversation could not be keyed (the identifier failed)",
	string(kvroute.RefuseStoreError):         "the handle store failed",
	string(kvroute.RefuseNotJSON):            "the decode answer was JSON but not an object",
	string(kvroute.RefuseStreamError):        "the stream broke",
	string(kvroute.RefuseClosedEarly):        "the stream was closed before its end",
	string(kvroute.RefuseNoConversationID):   "--key-mode conversation-id and the request named no conversation",
	string(kvroute.RefuseReasoning):          "the reply carries reasoning that the chat template drops from past turns: content rules cannot match it (token verification can)",
	string(kvroute.RefuseN):                  "n is not 1: several replies, no single sequence to continue",
	string(kvroute.RefuseTruncate):           "truncate_prompt_tokens is set: the engine's prompt is not the request's",
	string(kvroute.RefuseStopString):         "a stop string ended the reply and was cut from it",
	string(kvroute.RefuseContinueFinal):      "continue_final_message is set",
	string(kvroute.RefuseEcho):               "echo is set",
	string(kvroute.RefuseIncomplete):         "the reply could not be reassembled",
	string(kvroute.RefuseTooLarge):           "the reply is larger than content rules keep",
	string(kvroute.RefuseUnkeyable):          "the completions prompt is not one string long enough to key (or has a suffix)",
	string(kvroute.RefuseNoGenerationPrompt): "add_generation_prompt is false",
	string(kvroute.RefuseInlineReasoning):    "the reply's content holds a reasoning close tag (a reasoning model without a reasoning parser)",
	string(kvroute.RefuseThinkingOff):        "chat_template_kwargs.enable_thinking is not true",
	string(kvroute.RefuseTokenBoundary):      "the completions prompt and its reply do not meet at a clean token boundary",
	// why a later turn reused nothing
	string(kvroute.MissNotFound):          "no handle was retained for the conversation (the turn before was not retained)",
	string(kvroute.MissThreshold):         "fewer verified tokens than --recompute-threshold (the engines' kv_recompute_threshold): recomputing is cheaper",
	string(kvroute.MissUnverified):        "a handle was found but the prompt could not be verified (no render route, no token ids)",
	string(kvroute.MissMismatch):          "a handle was found but the prompt does not continue it",
	string(kvroute.MissExpired):           "the handle was past --retention-ttl",
	string(kvroute.MissCostModel):         "the cost model found recomputing faster than pulling",
	string(kvroute.MissPartialRefused):    "only a prefix matched and the handle cannot be cut to it (--block-size, KV groups, dcp_size)",
	string(kvroute.MissRestarted):         "the decode engine restarted since it issued the handle",
	string(kvroute.MissEngineUnconfirmed): "the decode engine's /metrics could not be read to rule out a restart",
	string(kvroute.MissEndpointGone):      "the handle's decode engine is no longer configured",
	string(kvroute.MissRenderMismatch):    "the prefill engine computed other tokens than it rendered: the handle was spent, the turn redone as a miss",
	string(kvroute.MissRetry):             "the prefill leg with the handle failed and was retried without it",
	string(kvroute.MissBadEntry):          "the retained entry was unusable",
	string(kvroute.MissNoKey):             "the conversation could not be keyed",
}

// noteMeaning explains reason; "finish_*" is a turn that did not finish
// normally.
func noteMeaning(reason string) string {
	if m, ok := noteMeanings[reason]; ok {
		return m
	}
	if f, ok := strings.CutPrefix(reason, "finish_"); ok {
		return "the turn finished as " + f + ", not normally (stop, length or tool calls): the engine holds no blocks for it"
	}
	return ""
}

// simulatedNoCompute reports whether every engine is a simulator whose
// answers take no modelled compute time: each answers GET /sim/stats
// (examples/vllmsim and kvroutetest engines serve it; vLLM answers 404)
// with ModelsCompute false, as without a cost profile (--profile) or with
// --speed 0. The probe's TTFTs then show the router's own path, not what
// reuse saves on real engines.
func simulatedNoCompute(ctx context.Context, rt http.RoundTripper, engines []engineFacts, timeout time.Duration) bool {
	if len(engines) == 0 {
		return false
	}
	client := &http.Client{Transport: rt}
	for _, e := range engines {
		var stats struct {
			ModelsCompute *bool
		}
		ok := func() bool {
			ctx, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			req, err := http.NewRequestWithContext(ctx, http.MethodGet, e.url+"/sim/stats", nil)
			if err != nil {
				return false
			}
			resp, err := client.Do(req)
			if err != nil {
				return false
			}
			defer resp.Body.Close()
			return resp.StatusCode == http.StatusOK &&
				json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&stats) == nil && stats.ModelsCompute != nil
		}()
		if !ok || *stats.ModelsCompute {
			return false
		}
	}
	return true
}

// writeNotes explains, under the probe's table, each reason its notes
// name and, for simulated engines that model no compute, that the TTFTs
// hold none.
func writeNotes(w io.Writer, runs []probeRun, noCompute bool) {
	var reasons []string
	seen := map[string]bool{}
	for _, r := range runs {
		if r.reason != "" && !seen[r.reason] {
			seen[r.reason] = true
			reasons = append(reasons, r.reason)
		}
	}
	if len(reasons) > 0 {
		fmt.Fprintf(w, "\nwhat the notes mean\n")
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, r := range reasons {
			if m := noteMeaning(r); m != "" {
				fmt.Fprintf(tw, "  %s\t%s\n", r, m)
			}
		}
		_ = tw.Flush()
	}
	if noCompute {
		fmt.Fprintf(w, "\nthese engines are simulators that model no compute (examples/vllmsim without --profile,\n"+
			"or --speed 0): TTFT off and on show the router's own path, not what reuse saves on real engines\n")
	}
}
