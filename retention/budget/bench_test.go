package budget_test

import (
	"encoding/binary"
	"fmt"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/bidikv/bidikv/retention/budget"
)

// keyOf is a store key of the length kvroute's continuation keys have
// (about 70 bytes).
func keyOf(i int) string {
	return fmt.Sprintf("bidikv:c1:%064d", i)
}

func BenchmarkAddReturn(b *testing.B) {
	bu, err := budget.New(budget.WithCapacity(1 << 40))
	if err != nil {
		b.Fatal(err)
	}
	keys := make([]string, 1024)
	for i := range keys {
		keys[i] = keyOf(i)
	}
	now := t0
	f := budget.Features{Class: "acme/qwen3", Turn: 2}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		k := keys[i%len(keys)]
		now = now.Add(time.Millisecond)
		if err := bu.Add(budget.Hold{Key: k, Engine: "d0", Tokens: 5000, Created: now, Expires: now.Add(ttl), Features: f, Saved: time.Second}); err != nil {
			b.Fatal(err)
		}
		bu.Return(k, now.Add(time.Second))
	}
}

// BenchmarkVictims chooses victims among the holds of one engine that is
// just over its budget (the cost each over-budget turn pays), at 1,000,
// 10,000 and 100,000 holds on the engine. An 8-GPU decode node has room
// for a few million tokens of KV: hundreds to a few thousand holds.
func BenchmarkVictims(b *testing.B) {
	for _, n := range []int{1_000, 10_000, 100_000} {
		b.Run(strconv.Itoa(n), func(b *testing.B) {
			bu, err := budget.New(budget.WithCapacity(int64(n) * 2 * 1024))
			if err != nil {
				b.Fatal(err)
			}
			now := t0
			for i := range n {
				c := now.Add(time.Duration(i) * ttl / time.Duration(n))
				if err := bu.Add(budget.Hold{Key: keyOf(i), Engine: "d0", Tokens: 1024, Created: c, Expires: c.Add(ttl),
					Features: budget.Features{Turn: 1 + i%7}, Saved: time.Second}); err != nil {
					b.Fatal(err)
				}
			}
			now = now.Add(ttl - time.Second)
			i := n
			b.ReportAllocs()
			for b.Loop() {
				// One more hold over the budget: one victim.
				if err := bu.Add(budget.Hold{Key: keyOf(i), Engine: "d0", Tokens: 1024, Created: now, Expires: now.Add(ttl), Saved: time.Second}); err != nil {
					b.Fatal(err)
				}
				i++
				if vs := bu.Victims("d0", 0, now); len(vs) != 1 {
					b.Fatal(len(vs))
				}
			}
		})
	}
}

func BenchmarkProbability(b *testing.B) {
	m, err := budget.NewModel()
	if err != nil {
		b.Fatal(err)
	}
	f := budget.Features{Turn: 3}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		_ = m.Probability(f, time.Duration(i%480)*time.Second, ttl)
	}
}

// BenchmarkRetained reports the heap a Budget retains per live hold (its
// key of 74 bytes included) and per ended hold still watched for the
// horizon (ns/op is meaningless here).
func BenchmarkRetained(b *testing.B) {
	const n = 100_000
	var perHold, perTomb float64
	for b.Loop() {
		heap := func() uint64 {
			runtime.GC()
			var ms runtime.MemStats
			runtime.ReadMemStats(&ms)
			return ms.HeapAlloc
		}
		keys := make([]string, n)
		for i := range keys {
			keys[i] = keyOf(i)
		}
		before := heap()
		bu, err := budget.New(budget.WithCapacity(1 << 40))
		if err != nil {
			b.Fatal(err)
		}
		for i, k := range keys {
			c := t0.Add(time.Duration(i) * time.Millisecond)
			if err := bu.Add(budget.Hold{Key: k, Engine: "d0", Tokens: 5000, Created: c, Expires: c.Add(time.Hour), Saved: time.Second}); err != nil {
				b.Fatal(err)
			}
		}
		perHold = float64(heap()-before) / n
		runtime.KeepAlive(bu)

		// Ended holds: each added and ended at once, so that only the
		// tombstones grow.
		before = heap()
		bu, err = budget.New(budget.WithCapacity(1 << 40))
		if err != nil {
			b.Fatal(err)
		}
		for i, k := range keys {
			c := t0.Add(time.Duration(i) * time.Millisecond)
			if err := bu.Add(budget.Hold{Key: k, Engine: "d0", Tokens: 5000, Created: c, Expires: c.Add(time.Hour), Saved: time.Second}); err != nil {
				b.Fatal(err)
			}
			bu.End(k, c)
		}
		perTomb = float64(heap()-before) / n
		runtime.KeepAlive(bu)
		runtime.KeepAlive(keys)
	}
	b.ReportMetric(perHold, "B/hold")
	b.ReportMetric(perTomb, "B/ended")
}

// fpBlocks is n block hashes laid out as a token fingerprint keeps them
// (8 bytes little endian each): the first shared ones common to every
// sequence, the rest of its own (named by own).
func fpBlocks(n, shared int, own uint64) []byte {
	out := make([]byte, 0, 8*n)
	for i := range n {
		h := uint64(i+1) * 0x9e3779b97f4a7c15
		if i >= shared {
			h ^= own << 32
		}
		out = binary.LittleEndian.AppendUint64(out, h)
	}
	return out
}

// fpPrefix is a Hold.Prefix reading the hashes of fpBlocks.
type fpPrefix []byte

func (f fpPrefix) Len() int        { return len(f) / 8 }
func (f fpPrefix) At(i int) uint64 { return binary.LittleEndian.Uint64(f[8*i:]) }

// BenchmarkAddReturnPrefix adds and returns a hold of 100,000 tokens with
// its Prefix (token verification), on an engine that holds 16 other
// conversations of 25,000 tokens, all sharing a 4,096-token system prompt:
// a turn's ledger work at 400 KB of history.
func BenchmarkAddReturnPrefix(b *testing.B) {
	const bs = 16
	bu, err := budget.New(budget.WithCapacity(1<<40), budget.WithBlockSize(bs))
	if err != nil {
		b.Fatal(err)
	}
	now := t0
	for i := range 16 {
		h := fpBlocks(25_000/bs, 4096/bs, uint64(i+1))
		if err := bu.Add(budget.Hold{Key: keyOf(i), Engine: "d0", Tokens: 25_000, Created: now, Expires: now.Add(ttl),
			Saved: time.Second, Prefix: fpPrefix(h), PrefixBlockSize: bs}); err != nil {
			b.Fatal(err)
		}
	}
	hashes := fpBlocks(100_000/bs, 4096/bs, 99)
	key := keyOf(99)
	f := budget.Features{Class: "acme/qwen3", Turn: 2}
	b.ReportAllocs()
	for b.Loop() {
		now = now.Add(time.Millisecond)
		if err := bu.Add(budget.Hold{Key: key, Engine: "d0", Tokens: 100_000, Created: now, Expires: now.Add(ttl), Features: f,
			Saved: time.Second, Prefix: fpPrefix(hashes), PrefixBlockSize: bs}); err != nil {
			b.Fatal(err)
		}
		bu.Return(key, now.Add(time.Second))
	}
	if u := bu.Usage(now)[0]; u.Holds != 16 {
		b.Fatal(u.Holds)
	}
}

// BenchmarkTurnPrefix is the ledger's work for one turn of 64 live
// conversations of 100,000 tokens (400 KB of history) on one engine just
// over its budget, all sharing a 4,096-token system prompt, in token
// verification: the conversation's hold returned, its next one added (its
// tokens extended by a turn's 512), and the victims chosen to make room.
func BenchmarkTurnPrefix(b *testing.B) {
	const bs, convs, tokens = 16, 64, 100_000
	bu, err := budget.New(budget.WithCapacity(convs*tokens), budget.WithBlockSize(bs), budget.WithFraction(1))
	if err != nil {
		b.Fatal(err)
	}
	now := t0
	hashes := make([][]byte, convs)
	for i := range convs {
		hashes[i] = fpBlocks((tokens+2048)/bs, 4096/bs, uint64(i+1))
		if err := bu.Add(budget.Hold{Key: keyOf(i), Engine: "d0", Tokens: tokens, Created: now, Expires: now.Add(ttl),
			Saved: time.Second, Prefix: fpPrefix(hashes[i]), PrefixBlockSize: bs}); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		c := i % convs
		now = now.Add(time.Millisecond)
		bu.Return(keyOf(c+convs*(i/convs)), now)
		n := tokens + 512*(1+i/convs%4)
		if err := bu.Add(budget.Hold{Key: keyOf(c + convs*(i/convs+1)), Engine: "d0", Tokens: n, Created: now, Expires: now.Add(ttl),
			Saved: time.Second, Prefix: fpPrefix(hashes[c]), PrefixBlockSize: bs}); err != nil {
			b.Fatal(err)
		}
		bu.Victims("d0", 0, now)
	}
}
