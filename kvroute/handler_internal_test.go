package kvroute

import (
	"bytes"
	"io"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

func TestReadBody(t *testing.T) {
	body := strings.Repeat("x", 1000)
	b, err := readBody(strings.NewReader(body), 1000, 4096)
	require.NoError(t, err)
	assert.Equal(t, body, string(b))
	assert.Equal(t, 1000, cap(b), "one buffer of the announced size")

	_, err = readBody(strings.NewReader(body[:10]), 1000, 4096)
	assert.ErrorIs(t, err, io.ErrUnexpectedEOF)

	_, err = readBody(strings.NewReader(body), 10, 4096)
	assert.ErrorContains(t, err, "longer than its Content-Length")

	// Unknown length, or one over the limit: read as it comes (the
	// caller's MaxBytesReader enforces the limit).
	b, err = readBody(bytes.NewReader([]byte(body)), -1, 4096)
	require.NoError(t, err)
	assert.Equal(t, body, string(b))
	b, err = readBody(bytes.NewReader([]byte(body)), 1<<20, 4096)
	require.NoError(t, err)
	assert.Len(t, b, 1000)
}
