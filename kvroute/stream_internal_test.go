package kvroute

import (
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/sse"
)

func nextEvent(t *testing.T, raw string) sse.Event {
	t.Helper()
	e, err := sse.NewReader(strings.NewReader(raw)).Next()
	require.NoError(t, err)
	return e
}

// The Responses stream capture takes the handle from response.completed,
// never forwards it or handle members on other lines, leaves a model's
// text alone, and fails an event with a handle where Responses puts none.
func TestResponsesStreamCapture(t *testing.T) {
	s := responsesAPI.newStream(false, false)

	delta := nextEvent(t, "event: response.output_text.delta\ndata: {\"type\":\"response.output_text.delta\",\"delta\":\"the word kv_transfer_params in prose\"}\n\n")
	out, err := s.Forward(delta)
	require.NoError(t, err)
	assert.Same(t, &delta.Raw[0], &out[0], "content is the client's: forwarded as is")

	comment := nextEvent(t, ": {\"remote_block_ids\":[[1]]}\nevent: response.in_progress\ndata: {\"type\":\"response.in_progress\",\"response\":{\"status\":\"in_progress\",\"kv_transfer_params\":null}}\n\n")
	out, err = s.Forward(comment)
	require.NoError(t, err)
	assert.NotContains(t, string(out), "remote_block_ids")
	assert.NotContains(t, string(out), kvKey)
	assert.Contains(t, string(out), "event: response.in_progress\n", "other lines kept")
	assert.False(t, s.Done())

	final := nextEvent(t, "event: response.completed\ndata: {\"type\":\"response.completed\",\"response\":{\"status\":\"completed\",\"output\":[{\"type\":\"message\",\"content\":[{\"type\":\"output_text\",\"text\":\"hi\"}]}],\"kv_transfer_params\":{\"remote_engine_id\":\"d\"}}}\n\n")
	out, err = s.Forward(final)
	require.NoError(t, err)
	assert.NotContains(t, string(out), kvKey)
	assert.True(t, s.Done())
	assert.Equal(t, `{"remote_engine_id":"d"}`, string(s.Handle()))
	assert.Equal(t, "hi", s.Reply().Content)
	assert.Equal(t, "stop", s.Reply().FinishReason)

	out, err = s.Forward(nextEvent(t, "data: {\"type\":\"x\",\"item\":{\"kv_transfer_params\":{}}}\n\n"))
	require.NoError(t, err)
	assert.Equal(t, "data: {\"type\":\"x\",\"item\":{}}\n\n", string(out), "removed at any depth")
	_, err = s.Forward(nextEvent(t, "data: {\"type\":\"x\",\"item\":{\"remote_engine_id\":\"d\"}}\n\n"))
	assert.ErrorIs(t, err, sse.ErrMalformedData)
	_, err = s.Forward(nextEvent(t, "data: not json kv_transfer_params\n\n"))
	assert.ErrorIs(t, err, sse.ErrMalformedData)
}
