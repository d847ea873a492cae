// Package metricspage is the one reader of an engine's GET /metrics page
// (Prometheus' text format, as vLLM's API server writes it) and its one
// set of validity rules. kvroute's restart check, its reading of decode
// pressure and its knowledge of block sizes, and the capability probe, all
// read a page through Parse.
//
// The rules: a line is read when it is a sample `name{labels} value
// [timestamp]` whose value is a finite number, or a comment (skipped);
// any other line, and a line longer than MaxLine, is skipped and the
// rest of the page read. A value outside plausible's ranges is refused:
// it is noted in Page.Absurd and its figure left out of the page (a
// usage, waiting count or cache configuration with one refused sample is
// left out whole: a sum without one rank would be wrong).
package metricspage

import (
	"bufio"
	"bytes"
	"errors"
	"io"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/bidikv/bidikv/kvroute/internal/plausible"
)

// MaxLine bounds one line of a page (an info gauge with every CacheConfig
// field is about 1.5 KiB); a longer one is skipped.
const MaxLine = 64 << 10

// Page is what one /metrics page tells, for one data-parallel rank.
type Page struct {
	// Start is process_start_time_seconds (the process collector vLLM's
	// API server registers); zero when absent or refused.
	Start time.Time
	// BadStart: a process_start_time_seconds was refused (Absurd).
	BadStart bool
	// Usage is the sum of Usages samples of vllm:kv_cache_usage_perc (of
	// vllm:gpu_cache_usage_perc, before vLLM 0.9, when the page has
	// none); BadUsage: one of them was refused.
	Usage    float64
	Usages   int
	BadUsage bool
	// Waiting sums vllm:num_requests_waiting; BadWaiting: a sample was
	// refused.
	Waiting    int
	BadWaiting bool
	// Preemptions sums the plausible samples of
	// vllm:num_preemptions_total; Preempts: there was one.
	Preemptions float64
	Preempts    bool
	// Caches are the vllm:cache_config_info samples, in page order.
	Caches []Cache
	// Offload: the page has a vllm:kv_offload_* series, or its # TYPE
	// line (an offloading connector is loaded; an older vLLM registers
	// the labelled series without samples until the first transfer).
	Offload bool
	// StoreBytes and LoadBytes sum vllm:kv_offload_store_bytes_total and
	// vllm:kv_offload_load_bytes_total (GPU to CPU tier, CPU tier to GPU);
	// on older engines, which export only the deprecated
	// vllm:kv_offload_total_bytes_total{transfer_type="GPU_to_CPU"|
	// "CPU_to_GPU"}, those. Negative samples are skipped.
	StoreBytes, LoadBytes float64
	// Absurd lists the values refused, as plausible.Reading writes them.
	Absurd []string
}

// Cache is one vllm:cache_config_info sample (one per data-parallel rank).
type Cache struct {
	// BlockSize is block_size; 0 when absent.
	BlockSize int
	// Size is the block size the engine's handles follow: its
	// full-attention groups' effective_attention_block_size (vLLM's
	// EngineCore sets it after the KV cache is made; None when the
	// groups differ, absent on older engines), else block_size; 0 when
	// neither is a plausible number.
	Size int
	// GPUBlocks is num_gpu_blocks (counting vLLM's null block); 0 absent.
	GPUBlocks int
	// KVTokens is kv_cache_size_tokens; 0 when absent.
	KVTokens int64
	// PrefixCaching is enable_prefix_caching as written: "True",
	// "False" or "".
	PrefixCaching string
	// HashAlgo is prefix_caching_hash_algo as written ("sha256",
	// "xxhash", ...); "" when absent.
	HashAlgo string
	// Bad: a value of the sample was refused (Absurd); the sample's
	// configuration is not to be taken.
	Bad bool
}

// Tokens returns the sample's KV capacity in tokens: kv_cache_size_tokens,
// else num_gpu_blocks less the null block × block_size; 0 when unknown.
func (c Cache) Tokens() int64 {
	if c.KVTokens > 0 {
		return c.KVTokens
	}
	if c.BlockSize > 0 && c.GPUBlocks > 1 {
		return int64(c.GPUBlocks-1) * int64(c.BlockSize) // at most 2^31 × 2^16: no overflow
	}
	return 0
}

// Capacity returns the KV capacity summed over the samples with a block
// size, and the block size of the last; ok is false when there is none,
// or when one was refused.
func (p *Page) Capacity() (tokens int64, blockSize int, ok bool) {
	for _, c := range p.Caches {
		if c.Bad {
			return 0, 0, false
		}
		if t := c.Tokens(); c.BlockSize > 0 && t > 0 {
			tokens += t
			blockSize = c.BlockSize
			ok = true
		}
	}
	return tokens, blockSize, ok
}

// Size returns the block size the engine's handles follow (Cache.Size, of
// the last sample that knows it); 0 when none does, or when a sample was
// refused.
func (p *Page) Size() int {
	size := 0
	for _, c := range p.Caches {
		if c.Bad {
			return 0
		}
		if c.Size > 0 {
			size = c.Size
		}
	}
	return size
}

// First returns the first sample that was not refused; ok is false when
// there is none.
func (p *Page) First() (Cache, bool) {
	for _, c := range p.Caches {
		if !c.Bad {
			return c, true
		}
	}
	return Cache{}, false
}

// Parse reads a page at now (the reader's clock, against which a process
// start is checked), keeping the samples whose engine label is rank (all
// of them for a negative rank, and those without the label).
func Parse(r io.Reader, rank int, now time.Time) Page {
	p := parser{rank: strconv.Itoa(rank), all: rank < 0, now: now}
	br := bufio.NewReaderSize(r, MaxLine)
	for {
		line, err := br.ReadSlice('\n')
		if errors.Is(err, bufio.ErrBufferFull) {
			for errors.Is(err, bufio.ErrBufferFull) { // too long: skipped to its end
				_, err = br.ReadSlice('\n')
			}
			if err != nil {
				break
			}
			continue
		}
		p.line(bytes.TrimRight(line, "\r\n"))
		if err != nil {
			break
		}
	}
	if p.page.Usages == 0 {
		p.page.Usage, p.page.Usages, p.page.BadUsage = p.legacy.Usage, p.legacy.Usages, p.legacy.BadUsage
	}
	if !p.flatBytes {
		p.page.StoreBytes, p.page.LoadBytes = p.legacy.StoreBytes, p.legacy.LoadBytes
	}
	return p.page
}

type parser struct {
	page   Page
	legacy Page // vllm:gpu_cache_usage_perc, vllm:kv_offload_total_bytes
	// flatBytes: the page has vllm:kv_offload_{store,load}_bytes samples.
	flatBytes bool
	rank      string
	all       bool
	now       time.Time
}

func (p *parser) line(line []byte) {
	if bytes.HasPrefix(line, []byte("# TYPE vllm:kv_offload_")) {
		p.page.Offload = true
	}
	name, labels, raw, ok := Sample(line)
	if !ok {
		return
	}
	v, err := strconv.ParseFloat(raw, 64)
	if err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
		return
	}
	if !p.all {
		if eng, has := Label(labels, "engine"); has && eng != p.rank {
			return
		}
	}
	pg := &p.page
	switch string(name) {
	case "process_start_time_seconds":
		if !pg.Start.IsZero() || pg.BadStart {
			return // the first one counts
		}
		if !p.plausible(plausible.Start, raw, v) {
			pg.BadStart = true
			return
		}
		sec, frac := math.Modf(v)
		pg.Start = time.Unix(int64(sec), int64(frac*1e9))
	case "vllm:kv_cache_usage_perc":
		pg.BadUsage = !p.plausible(plausible.Usage, raw, v) || pg.BadUsage
		pg.Usage += v
		pg.Usages++
	case "vllm:gpu_cache_usage_perc":
		p.legacy.BadUsage = !p.plausible(plausible.Usage, raw, v) || p.legacy.BadUsage
		p.legacy.Usage += v
		p.legacy.Usages++
	case "vllm:num_requests_waiting":
		pg.BadWaiting = !p.plausible(plausible.Waiting, raw, v) || pg.BadWaiting
		pg.Waiting += int(min(max(v, 0), plausible.MaxWaiting))
	case "vllm:num_preemptions_total":
		if p.plausible(plausible.Preemptions, raw, v) {
			pg.Preemptions += v
			pg.Preempts = true
		}
	case "vllm:cache_config_info":
		pg.Caches = append(pg.Caches, p.cache(labels))
	default:
		if bytes.HasPrefix(name, []byte("vllm:kv_offload_")) {
			p.offload(name, labels, v)
		}
	}
}

// offload reads a vllm:kv_offload_* sample.
func (p *parser) offload(name, labels []byte, v float64) {
	p.page.Offload = true
	if v < 0 {
		return
	}
	switch string(name) {
	case "vllm:kv_offload_store_bytes_total":
		p.page.StoreBytes += v
		p.flatBytes = true
	case "vllm:kv_offload_load_bytes_total":
		p.page.LoadBytes += v
		p.flatBytes = true
	case "vllm:kv_offload_total_bytes_total":
		switch t, _ := Label(labels, "transfer_type"); t {
		case "GPU_to_CPU":
			p.legacy.StoreBytes += v
		case "CPU_to_GPU":
			p.legacy.LoadBytes += v
		}
	}
}

// cache reads a vllm:cache_config_info sample's labels.
func (p *parser) cache(labels []byte) Cache {
	var c Cache
	num := func(key string, metric plausible.Metric) int64 {
		raw, has := Label(labels, key)
		if !has || raw == "" {
			return 0
		}
		v, err := strconv.ParseInt(raw, 10, 64)
		if err != nil {
			v = math.MaxInt64 // out of range, or not a number: implausible
		}
		if !p.plausible(metric, raw, float64(v)) {
			c.Bad = true
			return 0
		}
		return v
	}
	c.BlockSize = int(num("block_size", plausible.BlockSize))
	c.GPUBlocks = int(num("num_gpu_blocks", plausible.GPUBlocks))
	c.KVTokens = num("kv_cache_size_tokens", plausible.KVTokens)
	c.PrefixCaching, _ = Label(labels, "enable_prefix_caching")
	c.HashAlgo, _ = Label(labels, "prefix_caching_hash_algo")
	c.Size = c.BlockSize
	if raw, _ := Label(labels, "effective_attention_block_size"); raw != "" {
		if v, err := strconv.ParseInt(raw, 10, 64); err == nil && plausible.Check(plausible.BlockSize, float64(v), p.now) == "" {
			c.Size = int(v)
		}
	}
	if t := c.Tokens(); !c.Bad && c.BlockSize > 0 && t > 0 && t < int64(c.BlockSize) {
		p.page.Absurd = append(p.page.Absurd, plausible.Reading(plausible.KVTokens, strconv.FormatInt(t, 10), "below one block of "+strconv.Itoa(c.BlockSize)))
		c.Bad = true
	}
	if c.Bad {
		c.Size = 0
	}
	return c
}

// plausible reports whether v, written raw, is a plausible value of
// metric, and notes it in Absurd when it is not.
func (p *parser) plausible(metric plausible.Metric, raw string, v float64) bool {
	if why := plausible.Check(metric, v, p.now); why != "" {
		p.page.Absurd = append(p.page.Absurd, plausible.Reading(metric, raw, why))
		return false
	}
	return true
}

// Sample splits a sample line `name{labels} value [timestamp]` (the labels
// may be absent); ok is false for a comment, a blank line or a line it
// cannot read. labels are as written, without the braces.
func Sample(line []byte) (name, labels []byte, value string, ok bool) {
	if len(line) == 0 || line[0] == '#' {
		return nil, nil, "", false
	}
	i := bytes.IndexAny(line, "{ \t")
	if i <= 0 {
		return nil, nil, "", false
	}
	name, rest := line[:i], line[i:]
	if rest[0] == '{' {
		end := closing(rest)
		if end < 0 {
			return nil, nil, "", false
		}
		labels, rest = rest[1:end], rest[end+1:]
	}
	fields := strings.Fields(string(rest))
	if len(fields) == 0 || len(fields) > 2 {
		return nil, nil, "", false
	}
	return name, labels, fields[0], true
}

// closing returns the index of the brace closing the label set s opens,
// quoted values skipped; -1 when there is none.
func closing(s []byte) int {
	quoted := false
	for i := 1; i < len(s); i++ {
		switch c := s[i]; {
		case quoted && c == '\\':
			i++
		case c == '"':
			quoted = !quoted
		case !quoted && c == '}':
			return i
		}
	}
	return -1
}

// Label returns the value of label key in a label set `a="x",b="y"` (as
// Sample returns it), its escapes (\\, \" and \n) undone; has is false
// when the set has no such label or cannot be read.
func Label(labels []byte, key string) (value string, has bool) {
	for {
		labels = bytes.TrimLeft(labels, " ,")
		if len(labels) == 0 {
			return "", false
		}
		eq := bytes.IndexByte(labels, '=')
		if eq <= 0 || eq+1 >= len(labels) || labels[eq+1] != '"' {
			return "", false
		}
		name := bytes.TrimSpace(labels[:eq])
		rest := labels[eq+2:]
		q, escaped := 0, false
		for q < len(rest) && rest[q] != '"' {
			if rest[q] == '\\' {
				q++
				escaped = true
			}
			q++
		}
		if q >= len(rest) {
			return "", false
		}
		if string(name) == key {
			if !escaped {
				return string(rest[:q]), true
			}
			return unescape(rest[:q]), true
		}
		labels = rest[q+1:]
	}
}

func unescape(b []byte) string {
	var sb strings.Builder
	for i := 0; i < len(b); i++ {
		if b[i] == '\\' && i+1 < len(b) {
			i++
			if b[i] == 'n' {
				sb.WriteByte('\n')
				continue
			}
		}
		sb.WriteByte(b[i])
	}
	return sb.String()
}
