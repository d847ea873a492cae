package main

import (
	"fmt"
	"io"
	"slices"
	"time"
)

// report is the summary of a run.
type report struct {
	requests, failures int
	elapsed            time.Duration
	ttft, tpot, lat    []float64
	hits, misses, offs int
}

func summarize(recs []record, elapsed time.Duration) report {
	r := report{requests: len(recs), elapsed: elapsed}
	for _, rec := range recs {
		if rec.Error != "" {
			r.failures++
			continue
		}
		r.ttft = append(r.ttft, rec.TTFTMs)
		if rec.TPOTMs > 0 {
			r.tpot = append(r.tpot, rec.TPOTMs)
		}
		r.lat = append(r.lat, rec.LatencyMs)
		switch rec.Reuse {
		case "hit":
			r.hits++
		case "miss":
			r.misses++
		case "off":
			r.offs++
		}
	}
	return r
}

// percentile is the nearest-rank percentile of vs.
func percentile(vs []float64, p float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	s := slices.Clone(vs)
	slices.Sort(s)
	k := int(p/100*float64(len(s))+0.999999) - 1
	return s[min(max(k, 0), len(s)-1)]
}

func mean(vs []float64) float64 {
	if len(vs) == 0 {
		return 0
	}
	sum := 0.0
	for _, v := range vs {
		sum += v
	}
	return sum / float64(len(vs))
}

// hitRate is hits over routed turns, ok false when no response carried
// X-Bidikv-Reuse.
func (r report) hitRate() (float64, bool) {
	n := r.hits + r.misses + r.offs
	if n == 0 {
		return 0, false
	}
	return float64(r.hits) / float64(n), true
}

func (r report) print(w io.Writer) {
	fmt.Fprintf(w, "requests %d, failed %d, in %s (%.1f req/s)\n", r.requests, r.failures,
		r.elapsed.Round(time.Millisecond), float64(r.requests)/max(r.elapsed.Seconds(), 1e-9))
	fmt.Fprintf(w, "%-12s %9s %9s %9s %9s %9s\n", "", "mean", "p50", "p90", "p99", "max")
	for _, row := range []struct {
		name string
		vs   []float64
	}{{"ttft_ms", r.ttft}, {"tpot_ms", r.tpot}, {"latency_ms", r.lat}} {
		fmt.Fprintf(w, "%-12s %9.2f %9.2f %9.2f %9.2f %9.2f\n", row.name, mean(row.vs),
			percentile(row.vs, 50), percentile(row.vs, 90), percentile(row.vs, 99), percentile(row.vs, 100))
	}
	if hr, ok := r.hitRate(); ok {
		fmt.Fprintf(w, "reuse (X-Bidikv-Reuse): hit %d, miss %d, off %d, hit rate %.1f%%\n", r.hits, r.misses, r.offs, 100*hr)
	} else {
		fmt.Fprintln(w, "reuse: no X-Bidikv-Reuse header (not a bidikv router)")
	}
}
