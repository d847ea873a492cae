package otelobserver_test

import (
	"net/http"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/otelobserver"
)

// A turn that released its conversation's old hold through its prefill
// leg says so on its span, with the reason.
func TestReleasedAttribute(t *testing.T) {
	g := newRig(t, kvroute.WithThreshold(1<<20)) // no handle is ever attached: each turn replaces it
	conv := newConversation(false)
	status, _ := conv.turn(t, g.url, "List the files.", nil)
	require.Equal(t, http.StatusOK, status)
	// The decode engine's capacity is read in the background after the
	// first turn: the management applies once it is known.
	for range 5000 {
		if kv := g.router.DecodeKV(); len(kv) > 0 && kv[0].Capacity > 0 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	g.take()
	status, _ = conv.turn(t, g.url, "Run the tests.", nil)
	require.Equal(t, http.StatusOK, status)
	m := map[string]map[string]any{}
	for _, s := range g.take() {
		if s.Name == otelobserver.SpanTurn {
			a := attrs(s)
			assert.True(t, a[otelobserver.AttrReleased].AsBool())
			assert.Equal(t, string(kvroute.MissThreshold), a[otelobserver.AttrMissReason].AsString())
			m[s.Name] = nil
		}
	}
	require.Contains(t, m, otelobserver.SpanTurn)
}
