package sse_test

import (
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/sse"
)

// A stream of nothing but a byte order mark is no event: it comes out as
// one Incomplete block (so Raw still reproduces the input), then io.EOF.
func TestReaderBOMOnlyIsNoEvent(t *testing.T) {
	for _, in := range []string{"\xef\xbb\xbf"} {
		r := sse.NewReader(strings.NewReader(in))
		e, err := r.Next()
		require.NoError(t, err)
		assert.True(t, e.Incomplete, "a lone BOM must not look like a complete event")
		assert.False(t, e.HasData)
		assert.Equal(t, in, string(e.Raw))
		_, err = r.Next()
		assert.ErrorIs(t, err, io.EOF)
	}
	// A BOM followed by a line break is a (blank) complete block, as before.
	e, err := sse.NewReader(strings.NewReader("\xef\xbb\xbf\n")).Next()
	require.NoError(t, err)
	assert.False(t, e.Incomplete)
}

// A handle never reaches a client through a line other than data, nor
// nested in a choice.
// A final event far over the old 1 MiB bound (a 1M-token handle with two KV
// groups) is read whole by default.
// Arrays are scrubbed like objects, at every depth.
// TestCaptureStripsEventAfterEvent forwards events of different sizes
// through one stripping Capture, which reuses its buffers from one event to
// the next: each output must be that event with its token ids removed, as
// StripTokenIDs gives it alone, and a later event must not change what an
// earlier Forward returned once it was copied.
