package capability

import (
	"strings"
	"testing"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/plausible"
)

// FuzzMetrics feeds /metrics pages built around a label value nobody
// listed: the parser must never fail, and, the value escaped as the text
// format requires, must read the labels around it exactly (the oracle is
// the page's construction).
func FuzzMetrics(f *testing.F) {
	f.Add(`m`, "# HELP x\n", 16)
	f.Add(`a"b\c`+"\n", "process_start_time_seconds 1.7e+09\r\n", 64)
	f.Add(`},enable_prefix_caching="False"`, "vllm:cache_config_info{", 1)
	f.Add("\xff\x00", "", 0)
	f.Fuzz(func(t *testing.T, value, before string, block int) {
		if block < 0 || block > 1<<20 {
			return
		}
		esc := strings.NewReplacer(`\`, `\\`, "\n", `\n`, `"`, `\"`).Replace(value)
		page := before + "\n" + `vllm:cache_config_info{block_size="` + itoa(block) + `",model_name="` + esc +
			`",enable_prefix_caching="True",engine="0"} 1.0` + "\n"
		m := parseMetrics(strings.NewReader(page), time.Now())
		if strings.Contains(before, "vllm:cache_config_info{") || len(before) >= maxMetricsLine {
			return // the page's own lines may hold another sample, or be skipped
		}
		switch {
		case block < 1 || block > plausible.MaxBlockSize:
			// An implausible block size: the sample's configuration is
			// not taken, and the value is noted.
			if m.cacheInfo || len(m.implausible) != 1 || m.ranks != 1 {
				t.Fatalf("page %q: %+v", page, m)
			}
		case !m.cacheInfo || m.blockSize != block || m.prefixCaching != "True" || m.ranks != 1:
			t.Fatalf("page %q: %+v", page, m)
		}
		labels, ok := parseLabels(`{model_name="` + esc + `"} 1`)
		if !ok || labels["model_name"] != value {
			t.Fatalf("label %q read as %q (%v)", value, labels["model_name"], ok)
		}
		_ = parseMetrics(strings.NewReader(before+value), time.Now()) // anything at all: no panic
	})
}

func itoa(n int) string {
	if n == 0 {
		return "0"
	}
	var b []byte
	for ; n > 0; n /= 10 {
		b = append([]byte{byte('0' + n%10)}, b...)
	}
	return string(b)
}
