package main

import (
	"bufio"
	"bytes"
	"compress/gzip"
	"encoding/json"
	"fmt"
	"hash/maphash"
	"io"
	"os"
	"slices"
)

// traceBlock is the trace's hash block: 512 tokens.
const traceBlock = 512

// request is one line of a Mooncake trace.
type request struct {
	Timestamp    int64   `json:"timestamp"` // ms from the start
	InputLength  int     `json:"input_length"`
	OutputLength int     `json:"output_length"`
	HashIDs      []int64 `json:"hash_ids"`
}

// trace is a Mooncake trace with, for each request, the earlier requests
// whose next turn it is.
type trace struct {
	reqs []request
	// firsts[n] are the requests whose first extension is n: n starts
	// with all of their full blocks (at least 2), and no request between
	// them did. Only n can hit their holds.
	firsts [][]int32
	// turn[n] is n's turn number: 1 for a request that extends none, else
	// one more than the longest earlier request it extends.
	turn []int
	// extends counts the requests that extend at least one earlier one.
	extends int
	// gaps are the seconds from each extended request to its first
	// extension.
	gaps []float64
	// next[r] is the arrival (seconds) of r's first extension, -1 for none:
	// the future, which only the oracle policy reads.
	next []float64
}

// usedAt is when r's first extension arrives, -1 if none does.
func (t *trace) usedAt(r int) float64 { return t.next[r] }

// held is what a request's decode engine holds when it finishes: its
// prompt and its reply.
func (r request) held() int64 { return int64(r.InputLength + r.OutputLength) }

// at is the request's arrival in seconds.
func (r request) at() float64 { return float64(r.Timestamp) / 1e3 }

// loadTrace reads a Mooncake trace (JSON lines, gzipped or not), at most
// limit requests (0: all).
func loadTrace(path string, limit int) (*trace, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var r io.Reader = bufio.NewReader(f)
	if head, _ := r.(*bufio.Reader).Peek(2); bytes.Equal(head, []byte{0x1f, 0x8b}) {
		gz, err := gzip.NewReader(r)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		defer gz.Close()
		r = gz
	}
	dec := json.NewDecoder(r)
	var reqs []request
	for limit == 0 || len(reqs) < limit {
		var q request
		if err := dec.Decode(&q); err == io.EOF {
			break
		} else if err != nil {
			return nil, fmt.Errorf("%s: request %d: %w", path, len(reqs)+1, err)
		}
		if n := len(reqs); n > 0 && q.Timestamp < reqs[n-1].Timestamp {
			return nil, fmt.Errorf("%s: request %d: timestamps go back", path, n+1)
		}
		reqs = append(reqs, q)
	}
	if len(reqs) == 0 {
		return nil, fmt.Errorf("%s: no requests", path)
	}
	return link(reqs), nil
}

// link finds, for each request, the earlier requests it extends: those
// whose full blocks (at least 2) it starts with.
func link(reqs []request) *trace {
	t := &trace{reqs: reqs, firsts: make([][]int32, len(reqs)), turn: make([]int, len(reqs))}
	seed := maphash.MakeSeed()
	// byPrefix maps the hash of a request's full blocks to the requests
	// with exactly those full blocks.
	byPrefix := map[uint64][]int32{}
	extended := make([]bool, len(reqs))
	for n, q := range reqs {
		var h maphash.Hash
		h.SetSeed(seed)
		var buf [8]byte
		best, bestFull := -1, 0
		for f := 1; f <= len(q.HashIDs); f++ {
			v := q.HashIDs[f-1]
			for i := range buf {
				buf[i] = byte(v >> (8 * i))
			}
			h.Write(buf[:])
			if f < 2 {
				continue
			}
			for _, r := range byPrefix[h.Sum64()] {
				prev := reqs[r]
				if !slices.Equal(prev.HashIDs[:f], q.HashIDs[:f]) {
					continue // a hash collision
				}
				if !extended[r] {
					extended[r] = true
					t.firsts[n] = append(t.firsts[n], r)
					t.gaps = append(t.gaps, q.at()-prev.at())
				}
				if f > bestFull || (f == bestFull && int(r) > best) {
					best, bestFull = int(r), f
				}
			}
		}
		t.turn[n] = 1
		if best >= 0 {
			t.turn[n] = t.turn[best] + 1
			t.extends++
		}
		if full := q.InputLength / traceBlock; full >= 2 && full <= len(q.HashIDs) {
			h.Reset()
			for _, v := range q.HashIDs[:full] {
				for i := range buf {
					buf[i] = byte(v >> (8 * i))
				}
				h.Write(buf[:])
			}
			byPrefix[h.Sum64()] = append(byPrefix[h.Sum64()], int32(n))
		}
	}
	t.next = make([]float64, len(reqs))
	for i := range t.next {
		t.next[i] = -1
	}
	for n, rs := range t.firsts {
		for _, r := range rs {
			t.next[r] = reqs[n].at()
		}
	}
	return t
}
