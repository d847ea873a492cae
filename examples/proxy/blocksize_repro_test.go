package main

import (
	"net/http"
	"testing"

	"github.com/bidikv/bidikv/kvroute/kvroutetest"
)

func TestReproBlockSize64(t *testing.T) {
	cl := kvroutetest.NewCluster(t, 1, 1, kvroutetest.WithBlockSize(64))
	p := startInProcess(t, nil, "--prefill", cl.Prefill[0].URL(), "--decode", cl.Decode[0].URL())
	status, _, body := p.do(t, http.MethodPost, "/v1/chat/completions", plainChat(reuseSystem, "Turn 1"), "Content-Type", "application/json")
	t.Logf("%d %s", status, body)
	t.Logf("stderr: %s", p.stderr.String())
}
