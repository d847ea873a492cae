package bidikv_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
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

// `go doc ./kvroute` shows the package's index within 80 lines: the
// package doc says what the router is, the turn, verification, errors,
// options and concurrency, and sends the reader to docs/kvroute.md for the
// rest.
func TestPackageDocShort(t *testing.T) {
	goBin := filepath.Join(runtime.GOROOT(), "bin", "go")
	if _, err := os.Stat(goBin); err != nil {
		goBin = "go"
	}
	out, err := exec.Command(goBin, "doc", "./kvroute").Output()
	require.NoError(t, err)
	lines := strings.Split(string(out), "\n")
	index := -1
	for i, l := range lines {
		if regexp.MustCompile(`^(const|func|type|var) `).MatchString(l) {
			index = i
			break
		}
	}
	require.GreaterOrEqual(t, index, 0, "go doc ./kvroute shows an index")
	assert.LessOrEqual(t, index, 80, "lines of go doc ./kvroute before its index")
	doc := strings.Join(lines[:index], "\n")
	for _, want := range []string{"# The turn", "# Verification", "# Errors", "safe for concurrent use", "docs/kvroute.md"} {
		assert.Contains(t, doc, want)
	}
	_, err = os.Stat(filepath.Join("docs", "kvroute.md"))
	assert.NoError(t, err)
}
