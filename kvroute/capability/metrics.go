package capability

import (
	"bufio"
	"errors"
	"io"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/plausible"
)

// metricsFacts is what GET /metrics tells.
type metricsFacts struct {
	start     time.Time
	cacheInfo bool // a vllm:cache_config_info sample was found
	// From the first vllm:cache_config_info sample.
	prefixCaching string // "True", "False" or ""
	blockSize     int
	numGPUBlocks  int
	kvTokens      int64
	ranks         int // vllm:cache_config_info samples (one per data-parallel rank)
	// implausible lists the values plausible.Check refused, as
	// plausible.Reading writes them; the facts they would set are left
	// unset.
	implausible []string
}

// maxMetricsLine bounds one line of /metrics (an info gauge with every
// CacheConfig field is about 1.5 KiB).
const maxMetricsLine = 64 << 10

// parseMetrics reads Prometheus' text format for process_start_time_seconds
// and vllm:cache_config_info, read at now. Lines it cannot read are
// skipped; an implausible value is noted and not taken.
func parseMetrics(r io.Reader, now time.Time) metricsFacts {
	var m metricsFacts
	br := bufio.NewReaderSize(r, maxMetricsLine)
	for {
		raw, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			// A line longer than any this reads: skip to its end.
			for errors.Is(err, bufio.ErrBufferFull) {
				_, err = br.ReadSlice('\n')
			}
			if err != nil {
				return m
			}
			continue
		}
		m.line(strings.TrimRight(string(raw), "\r\n"), now)
		if err != nil {
			return m
		}
	}
}

// line reads one line of the text format.
func (m *metricsFacts) line(line string, now time.Time) {
	switch {
	case strings.HasPrefix(line, "process_start_time_seconds "):
		raw := strings.TrimSpace(strings.TrimPrefix(line, "process_start_time_seconds "))
		if v, err := strconv.ParseFloat(raw, 64); err == nil && v > 0 && m.plausible(plausible.Start, raw, v, now) {
			sec, frac := math.Modf(v)
			m.start = time.Unix(int64(sec), int64(frac*1e9)).UTC()
		}
	case strings.HasPrefix(line, "vllm:cache_config_info{"):
		labels, ok := parseLabels(line[len("vllm:cache_config_info"):])
		if !ok {
			return
		}
		m.ranks++
		if m.cacheInfo {
			return
		}
		var bs, blocks, tokens int64
		for _, l := range []struct {
			key    string
			metric plausible.Metric
			v      *int64
		}{{"block_size", plausible.BlockSize, &bs}, {"num_gpu_blocks", plausible.GPUBlocks, &blocks}, {"kv_cache_size_tokens", plausible.KVTokens, &tokens}} {
			raw, has := labels[l.key]
			if !has || raw == "" {
				continue
			}
			v, err := strconv.ParseInt(raw, 10, 64)
			if err != nil {
				v = math.MaxInt64 // out of range, or not a number
			}
			if !m.plausible(l.metric, raw, float64(v), now) {
				return // this rank's configuration is not taken
			}
			*l.v = v
		}
		m.cacheInfo = true
		m.prefixCaching = labels["enable_prefix_caching"]
		m.blockSize, m.numGPUBlocks, m.kvTokens = int(bs), int(blocks), tokens
		// The block size the engine's handles follow: its full-attention
		// groups' (EngineCore's _initialize_effective_attention_block_size;
		// None when they differ, absent on older engines), else block_size.
		if v, err := strconv.ParseInt(labels["effective_attention_block_size"], 10, 64); err == nil &&
			plausible.Check(plausible.BlockSize, float64(v), now) == "" {
			m.blockSize = int(v)
		}
	}
}

// plausible reports whether v, written raw, is a plausible value of
// metric, and notes it when it is not.
func (m *metricsFacts) plausible(metric plausible.Metric, raw string, v float64, now time.Time) bool {
	if why := plausible.Check(metric, v, now); why != "" {
		m.implausible = append(m.implausible, plausible.Reading(metric, raw, why))
		return false
	}
	return true
}

// parseLabels reads `{a="x",b="y\"z"} value` into a map; ok is false for a
// malformed label set.
func parseLabels(s string) (map[string]string, bool) {
	if !strings.HasPrefix(s, "{") {
		return nil, false
	}
	s = s[1:]
	out := map[string]string{}
	for {
		s = strings.TrimLeft(s, " ,")
		if strings.HasPrefix(s, "}") {
			return out, true
		}
		eq := strings.IndexByte(s, '=')
		if eq <= 0 || eq+1 >= len(s) || s[eq+1] != '"' {
			return nil, false
		}
		name := strings.TrimSpace(s[:eq])
		s = s[eq+2:]
		var v strings.Builder
		closed := false
		for i := 0; i < len(s); i++ {
			c := s[i]
			if c == '\\' && i+1 < len(s) {
				i++
				switch s[i] {
				case 'n':
					v.WriteByte('\n')
				default:
					v.WriteByte(s[i])
				}
				continue
			}
			if c == '"' {
				s = s[i+1:]
				closed = true
				break
			}
			v.WriteByte(c)
		}
		if !closed {
			return nil, false
		}
		out[name] = v.String()
	}
}
