package bidikv_test

import (
	"os"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestReadmeEmbed: the README's embedding snippet is examples/embed's
// code, line for line in order, serving the four APIs.
func TestReadmeEmbed(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	m := regexp.MustCompile("(?s)## Embed it\n\n```go\n(.*?)```").FindSubmatch(readme)
	require.NotNil(t, m, "the README's Embed it snippet")
	src, err := os.ReadFile("examples/embed/main.go")
	require.NoError(t, err)
	code := string(src)
	at := 0
	for _, line := range strings.Split(strings.TrimSpace(string(m[1])), "\n") {
		line = strings.TrimSpace(line)
		i := strings.Index(code[at:], line)
		require.GreaterOrEqual(t, i, 0, "README line %q is not in examples/embed/main.go (in order)", line)
		at += i + len(line)
	}
	for _, api := range []string{"PathChatCompletions", "PathCompletions", "PathResponses", "PathMessages"} {
		assert.Contains(t, string(m[1]), `mux.Handle("POST "+kvroute.`+api+`, router)`)
	}
}
