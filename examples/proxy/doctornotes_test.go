package main

import (
	"context"
	"regexp"
	"strings"
	"testing"
	"time"

	"io"
	"net/http"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

// The doctor's --probe notes name a reason (turn 1 not retained:
// unrendered); where it prints them it says what each means, and that
// simulated engines without a cost profile model no compute, so their
// TTFTs say nothing of what reuse saves.
func TestDoctorNotesExplained(t *testing.T) {
	reg := kvroutetest.NewRegistry()
	p := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithRenderRoutes(false))
	d := kvroutetest.NewEngine(t, kvroutetest.WithRegistry(reg), kvroutetest.WithRenderRoutes(false))
	stdout, stderr := &syncBuffer{}, &syncBuffer{}
	err := run(context.Background(), []string{"doctor", "--probe", "--prefill", p.URL(), "--decode", d.URL()}, noEnv, stdout, stderr)
	require.NoError(t, err, stderr.String())
	out := stdout.String()

	notes := regexp.MustCompile(`(?m)(?:not retained|miss): ([a-z_]+)\s*$`).FindAllStringSubmatch(out, -1)
	require.NotEmpty(t, notes, out)
	_, legend, ok := strings.Cut(out, "\nwhat the notes mean\n")
	require.True(t, ok, "the notes are explained under the probe's table:\n%s", out)
	for _, n := range notes {
		assert.Regexp(t, `(?m)^  `+n[1]+` +\S`, legend, "the meaning of %s", n[1])
		assert.Contains(t, legend, noteMeaning(n[1]))
	}
	for _, r := range []string{"no_stream_handle", "unrendered", "token_verification_only"} {
		assert.Contains(t, legend, "  "+r+" ", "a stock engine without render routes shows %s", r)
	}
	assert.True(t, strings.Contains(out, "simulators that model no compute"), "the zero-cost note:\n%s", out)

	j, err, raw := doctor(t, p, d, "--probe")
	require.NoError(t, err)
	var withNote int
	for _, r := range j.Probe {
		if strings.Contains(r.Note, "not retained: ") || strings.HasPrefix(r.Note, "miss: ") {
			withNote++
			assert.NotEmpty(t, r.Meaning, "%s: %s", r.API, r.Note)
		}
	}
	assert.Positive(t, withNote, raw)
	assert.True(t, j.NoCompute, raw)
}

// Every reason kvroute reports has a meaning the doctor can print.
func TestNoteMeaningsComplete(t *testing.T) {
	for _, r := range []kvroute.Refusal{
		kvroute.RefuseNoStreamHandle, kvroute.RefuseNoHandle, kvroute.RefuseUnrendered, kvroute.RefuseTokenOnly,
		kvroute.RefuseRenderPending, kvroute.RefuseReuseOff, kvroute.RefuseDecodeLocal, kvroute.RefuseUnusableHandle,
		kvroute.RefuseInvalidHandle, kvroute.RefusePushHandle, kvroute.RefuseHandleTooLarge, kvroute.RefuseIdentifierError,
		kvroute.RefuseStoreError, kvroute.RefuseNotJSON, kvroute.RefuseStreamError, kvroute.RefuseClosedEarly,
		kvroute.RefuseNoConversationID, kvroute.RefuseReasoning, kvroute.RefuseN, kvroute.RefuseTruncate,
		kvroute.RefuseStopString, kvroute.RefuseContinueFinal, kvroute.RefuseEcho, kvroute.RefuseIncomplete,
		kvroute.RefuseTooLarge, kvroute.RefuseUnkeyable, kvroute.RefuseNoGenerationPrompt, kvroute.RefuseInlineReasoning,
		kvroute.RefuseThinkingOff, kvroute.RefuseTokenBoundary, "finish_abort",
	} {
		assert.NotEmpty(t, noteMeaning(string(r)), r)
	}
	for _, m := range []kvroute.MissReason{
		kvroute.MissNoKey, kvroute.MissNotFound, kvroute.MissExpired, kvroute.MissThreshold, kvroute.MissStoreError,
		kvroute.MissBadEntry, kvroute.MissRetry, kvroute.MissMismatch, kvroute.MissUnverified, kvroute.MissPartialRefused,
		kvroute.MissEndpointGone, kvroute.MissRestarted, kvroute.MissEngineUnconfirmed, kvroute.MissRenderMismatch,
		kvroute.MissCostModel,
	} {
		assert.NotEmpty(t, noteMeaning(string(m)), m)
	}
}

// Engines that sleep their modelled compute (a cost profile, a speed)
// get no such line: their TTFTs hold the compute they model.
func TestDoctorEnginesModellingCompute(t *testing.T) {
	prof, ok := kvroutetest.LookupProfile("qwen3-32b")
	require.True(t, ok)
	reg := kvroutetest.NewRegistry()
	opts := []kvroutetest.Option{kvroutetest.WithRegistry(reg), kvroutetest.WithProfile(prof), kvroutetest.WithSpeed(50)}
	p := kvroutetest.NewEngine(t, opts...)
	d := kvroutetest.NewEngine(t, opts...)
	stdout := &syncBuffer{}
	require.NoError(t, run(context.Background(), []string{"doctor", "--probe", "--prefill", p.URL(), "--decode", d.URL()}, noEnv, stdout, io.Discard))
	assert.NotContains(t, stdout.String(), "model no compute")
	j, err, raw := doctor(t, p, d, "--probe")
	require.NoError(t, err)
	assert.False(t, j.NoCompute, raw)

	// engines that are not simulators (vLLM answers GET /sim/stats with 404) get no line either
	assert.False(t, simulatedNoCompute(context.Background(), http.DefaultTransport, []engineFacts{{url: "http://127.0.0.1:1"}}, time.Second))
	assert.False(t, simulatedNoCompute(context.Background(), http.DefaultTransport, nil, time.Second))
}
