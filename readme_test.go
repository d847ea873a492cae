package bidikv_test

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"unicode"

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
		assert.True(t, strings.Contains(doc, want), "the package doc says %q", want)
	}
	_, err = os.Stat(filepath.Join("docs", "kvroute.md"))
	assert.NoError(t, err)
}

// The README leads with what bidikv is, the 30-second start, the demo and
// links, in at most 250 lines, and names the licence.
func TestReadmeShape(t *testing.T) {
	raw, err := os.ReadFile("README.md")
	require.NoError(t, err)
	readme := string(raw)
	assert.LessOrEqual(t, strings.Count(readme, "\n"), 250, "README.md lines")
	at := 0
	for _, h := range []string{"# bidikv\n", "\n## Start in 30 seconds\n", "<!-- quickstart:begin", "\n## The demo\n", "\n## Documentation\n"} {
		i := strings.Index(readme[at:], h)
		require.GreaterOrEqual(t, i, 0, "README.md has %q after what comes before it", h)
		at += i
	}
	assert.Contains(t, readme, "[LICENSE](LICENSE)")
	license, err := os.ReadFile("LICENSE")
	require.NoError(t, err)
	assert.Contains(t, string(license), "Apache License\n                           Version 2.0, January 2004")
	assert.Contains(t, string(license), "END OF TERMS AND CONDITIONS")
}

// The README's demo output is the demo's real output, abridged: each of
// its lines is a line of the whole output in docs/demo.md, in order.
func TestReadmeDemoOutput(t *testing.T) {
	readme, err := os.ReadFile("README.md")
	require.NoError(t, err)
	demo, err := os.ReadFile(filepath.Join("docs", "demo.md"))
	require.NoError(t, err)
	block := regexp.MustCompile("(?s)```text\n(\\$ go run ./examples/demo\n.*?)```").FindSubmatch(readme)
	require.NotNil(t, block, "the README's demo output")
	whole := regexp.MustCompile("(?s)```text\n(\\$ go run ./examples/demo\n.*?)```").FindSubmatch(demo)
	require.NotNil(t, whole, "docs/demo.md's demo output")
	lines := strings.Split(string(whole[1]), "\n")
	at := 0
	for _, l := range strings.Split(strings.TrimSuffix(string(block[1]), "\n"), "\n") {
		if l == "..." {
			continue
		}
		found := false
		for ; at < len(lines); at++ {
			if lines[at] == l {
				found = true
				at++
				break
			}
		}
		assert.True(t, found, "README demo line %q is not in docs/demo.md's output (in order)", l)
	}
}

// Every link between the README, the docs pages and the other pages at the
// root resolves: the file exists, and a #fragment names one of its
// headings.
func TestDocLinks(t *testing.T) {
	pages, _ := filepath.Glob(filepath.Join("docs", "*.md"))
	pages = append(pages, "README.md", "GUARANTEES.md", "ARCHITECTURE.md", "BENCHMARKS.md", filepath.Join("examples", "proxy", "README.md"))
	linkRE := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	for _, page := range pages {
		raw, err := os.ReadFile(page)
		require.NoError(t, err)
		text := regexp.MustCompile("(?s)```.*?```").ReplaceAllString(string(raw), "")
		for _, m := range linkRE.FindAllStringSubmatch(text, -1) {
			link := m[1]
			if strings.Contains(link, "://") || strings.HasPrefix(link, "mailto:") {
				continue
			}
			file, frag, _ := strings.Cut(link, "#")
			target := page
			if file != "" {
				target = filepath.Join(filepath.Dir(page), file)
			}
			_, err := os.Stat(target)
			if !assert.NoError(t, err, "%s links to %s", page, link) || frag == "" || !strings.HasSuffix(target, ".md") {
				continue
			}
			b, err := os.ReadFile(target)
			require.NoError(t, err)
			assert.Contains(t, anchors(string(b)), frag, "%s links to %s: no such heading", page, link)
		}
	}
}

// anchors returns the GitHub anchors of a Markdown page's headings.
func anchors(page string) map[string]bool {
	out := map[string]bool{}
	page = regexp.MustCompile("(?s)```.*?```").ReplaceAllString(page, "")
	for _, line := range strings.Split(page, "\n") {
		h, ok := strings.CutPrefix(strings.TrimLeft(line, "#"), " ")
		if !ok || !strings.HasPrefix(line, "#") {
			continue
		}
		var b strings.Builder
		for _, r := range strings.ToLower(h) {
			switch {
			case r == ' ':
				b.WriteRune('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		out[b.String()] = true
	}
	return out
}

// A figure of what reuse does (a speedup, a TTFT) says whether it is
// modelled (simulated engines) or measured, and so where it comes from:
// every paragraph of the README and the docs pages that gives one says
// modelled or measured.
func TestReuseClaimsLabelled(t *testing.T) {
	pages, _ := filepath.Glob(filepath.Join("docs", "*.md"))
	pages = append(pages, "README.md")
	claimRE := regexp.MustCompile(`(?i)\b\d+(\.\d+)?\s?[x×](\s|[,.;)]|$)|TTFT[^.]*\d+(\.\d+)?\s?(ms|s)\b`)
	labelRE := regexp.MustCompile(`(?i)modelled|measured`)
	for _, page := range pages {
		raw, err := os.ReadFile(page)
		require.NoError(t, err)
		text := regexp.MustCompile("(?s)```.*?```").ReplaceAllString(string(raw), "")
		for _, para := range strings.Split(text, "\n\n") {
			if claimRE.MatchString(para) && !strings.HasPrefix(strings.TrimSpace(para), "|") {
				assert.Regexp(t, labelRE, para, "%s: a figure without modelled or measured", page)
			}
		}
	}
}
