package main

import (
	"io"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute"
	"github.com/bidikv/bidikv/kvroute/capability"
)

// --decode-stream takes engine, buffered, or buffered:API[,API]; Responses
// and unknown APIs are refused with a hint.
func TestDecodeStreamFlag(t *testing.T) {
	all := []string{kvroute.PathChatCompletions, kvroute.PathCompletions, kvroute.PathMessages}
	for _, tc := range []struct {
		in, err, str string
		want         []string
	}{
		{in: "engine", str: "engine"},
		{in: "buffered", want: all, str: "buffered"},
		{in: "buffered:messages", want: []string{kvroute.PathMessages}, str: "buffered:messages"},
		{in: "buffered:messages,chat,messages", want: []string{kvroute.PathMessages, kvroute.PathChatCompletions}, str: "buffered:chat,messages"},
		{in: "buffered:responses", err: "never buffered"},
		{in: "buffered:embeddings", err: "use chat, completions or messages"},
		{in: "buffer", err: "use engine, buffered"},
		{in: "", err: "use engine, buffered"},
	} {
		var paths []string
		d := decodeStream{&paths}
		err := d.Set(tc.in)
		if tc.err != "" {
			require.Error(t, err, tc.in)
			assert.Contains(t, err.Error(), tc.err)
			continue
		}
		require.NoError(t, err, tc.in)
		assert.Equal(t, tc.want, paths, tc.in)
		assert.Equal(t, tc.str, d.String(), tc.in)
	}
	c, err := parseConfig([]string{"--prefill", "http://127.0.0.1:1", "--decode", "http://127.0.0.1:2", "--decode-stream", "buffered:messages"}, func(string) string { return "" }, io.Discard)
	require.NoError(t, err)
	assert.Equal(t, []string{kvroute.PathMessages}, c.bufferStreams)
	assert.True(t, c.buffers(capability.Messages))
	assert.False(t, c.buffers(capability.Chat))
}
