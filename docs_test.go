package bidikv_test

import (
	"io/fs"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/kvroute/capability"
)

// userFacing returns the repository's files users read: every Markdown
// page and every non-test Go file (its doc comments and the strings it
// prints), outside .git, node_modules and testdata.
func userFacing(t *testing.T) map[string]string {
	t.Helper()
	files := map[string]string{}
	err := filepath.WalkDir(".", func(path string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.IsDir() {
			switch d.Name() {
			case ".git", "node_modules", "testdata":
				return filepath.SkipDir
			}
			return nil
		}
		if strings.HasSuffix(path, ".md") || (strings.HasSuffix(path, ".go") && !strings.HasSuffix(path, "_test.go")) {
			b, err := os.ReadFile(path)
			if err != nil {
				return err
			}
			files[path] = string(b)
		}
		return nil
	})
	require.NoError(t, err)
	return files
}

// Every --kv-transfer-config the repository gives users is the prefill
// engines' (kv_role kv_both) or the decode engines' (kv_consumer), as
// capability.KVTransferPrefill and KVTransferDecode hold them and
// docs/engines.md explains; a page that shows one shows both, and a shell
// variable holds one engine's: KVP the prefill engines', KVD the decode
// engines'. Never one configuration for every engine.
func TestKVRolesConsistent(t *testing.T) {
	configRE := regexp.MustCompile(`\{"kv_connector":"NixlConnector".*?\}\}`)
	assignRE := regexp.MustCompile(`(\w+)='(\{"kv_connector":"NixlConnector".*?\}\})'`)
	seen := 0
	for path, text := range userFacing(t) {
		configs := configRE.FindAllString(text, -1)
		if len(configs) == 0 {
			continue
		}
		seen += len(configs)
		p, d := 0, 0
		for _, c := range configs {
			switch c {
			case capability.KVTransferPrefill:
				p++
			case capability.KVTransferDecode:
				d++
			default:
				t.Errorf("%s: %s is neither the prefill nor the decode engines' configuration", path, c)
			}
		}
		assert.True(t, p > 0 && d > 0, "%s shows %d prefill and %d decode configurations: both, or neither", path, p, d)
		for _, m := range assignRE.FindAllStringSubmatch(text, -1) {
			want := map[string]string{"KVP": capability.KVTransferPrefill, "KVD": capability.KVTransferDecode}[m[1]]
			assert.Equal(t, want, m[2], "%s: %s=", path, m[1])
		}
		assert.False(t, strings.Contains(text, `"$KV"`), "%s: one configuration for every engine", path)
	}
	assert.GreaterOrEqual(t, seen, 6, "the READMEs, docs/engines.md, capability and vllmsim show them")
	engines, err := os.ReadFile(filepath.Join("docs", "engines.md"))
	require.NoError(t, err)
	assert.Contains(t, string(engines), "KVP='"+capability.KVTransferPrefill+"'")
	assert.Contains(t, string(engines), "KVD='"+capability.KVTransferDecode+"'")
	assert.Contains(t, capability.FixBidirectional, capability.KVTransferPrefill+"' on every prefill engine")
	assert.Contains(t, capability.FixBidirectional, capability.KVTransferDecode+"' on every decode engine")
}

// What users read names no issue of this project's tracker ("issue 23",
// "(issue #14)"): it says what a change did. vLLM's and other projects'
// issues, named with their project, are references.
func TestNoProjectIssueNumbers(t *testing.T) {
	issueRE := regexp.MustCompile(`(?i)(\S+)?[\s(]+issues?\s+#?\d+|^issues?\s+#?\d+`)
	for path, text := range userFacing(t) {
		for _, line := range strings.Split(text, "\n") {
			for _, m := range issueRE.FindAllStringSubmatch(line, -1) {
				before := strings.ToLower(m[1])
				if strings.Contains(before, "vllm") || strings.Contains(before, "go") && strings.Contains(line, "go.dev/issue") {
					continue
				}
				t.Errorf("%s: %q names an issue of this project", path, strings.TrimSpace(line))
			}
		}
	}
}
