package kvroute_test

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/transport"
)

// flushCounter is a client writer that counts flushes and the events
// written before each.
type flushCounter struct {
	bytes.Buffer
	flushes int
}

func (f *flushCounter) Flush() { f.flushes++ }

// TestWriteToCoalescesFlushes forwards a stream that the decode engine
// sends in one write: the events reach the client unchanged, with one flush
// for each of the first two events and one for the rest, not one per
// event.
func TestWriteToCoalescesFlushes(t *testing.T) {
	p, _ := cannedEngines(t)
	const events = 100
	var stream strings.Builder
	for i := range events {
		fmt.Fprintf(&stream, "data: {\"id\":\"cmpl-d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\" tok%d\"},\"finish_reason\":null}]}\n\n", i)
	}
	final := "data: {\"id\":\"cmpl-d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}],\"kv_transfer_params\":" + cannedDHandle + "}\n\ndata: [DONE]\n\n"
	ds := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.Copy(io.Discard, r.Body)
		w.Header().Set("Content-Type", "text/event-stream")
		_, _ = io.WriteString(w, stream.String()+final)
	}))
	defer ds.Close()
	rt, err := transport.NewTransport()
	require.NoError(t, err)
	defer rt.CloseIdleConnections()
	r, err := kvroute.New(kvroute.WithPrefill(p), kvroute.WithDecode(ds.URL), kvroute.WithTransport(rt))
	require.NoError(t, err)
	defer r.Close()
	resp, err := r.Do(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions, Header: http.Header{}, Body: newBenchConv("flush ", 1<<10).body()})
	require.NoError(t, err)
	defer resp.Close()
	var out flushCounter
	_, err = resp.WriteTo(&out)
	require.NoError(t, err)
	assert.Equal(t, stream.String()+"data: {\"id\":\"cmpl-d\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"sim-model\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\ndata: [DONE]\n\n", out.String(), "events unchanged but for the handle")
	assert.GreaterOrEqual(t, out.flushes, 3, "the first two events flushed alone, then the rest")
	assert.Less(t, out.flushes, 10, "not one flush per event (%d events)", events+2)
}
