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

// famBlocks names n blocks as fpBlocks does, without storing them.
type famBlocks struct {
	n, shared int
	own       uint64
}

func (f famBlocks) Len() int { return f.n }

func (f famBlocks) At(i int) uint64 {
	h := uint64(i+1) * 0x9e3779b97f4a7c15
	if i >= f.shared {
		h ^= f.own << 32
	}
	return h
}

// prefixEngine is a ledger with convs holds of 100,000 tokens in blocks
// of 16 on engine d0 (400 KB of history each), with their Prefix (token
// verification): they share a 4,096-token system prompt and part after
// it. It returns the ledger and the next hold's blocks.
func prefixEngine(b *testing.B, convs int, opts ...budget.Option) (*budget.Budget, []byte) {
	const bs, tokens = 16, 100_000
	bu, err := budget.New(append([]budget.Option{budget.WithCapacity(1 << 40), budget.WithBlockSize(bs)}, opts...)...)
	if err != nil {
		b.Fatal(err)
	}
	for i := range convs {
		c := t0.Add(time.Duration(i) * time.Second)
		if err := bu.Add(budget.Hold{Key: keyOf(i), Engine: "d0", Tokens: tokens, Created: c, Expires: c.Add(ttl),
			Features: budget.Features{Turn: 1 + i%7}, Saved: time.Second,
			Prefix: fpPrefix(fpBlocks(tokens/bs, 4096/bs, uint64(i+1))), PrefixBlockSize: bs}); err != nil {
			b.Fatal(err)
		}
	}
	return bu, fpBlocks(tokens/bs, 4096/bs, 1<<20)
}

// BenchmarkAddReturnPrefix adds and returns a hold of 100,000 tokens with
// its Prefix (token verification, blocks of 16: 6,250 of them) on an
// engine that holds 64 other conversations of that size, all sharing a
// 4,096-token system prompt: the ledger's work for a turn at 400 KB of
// history. Warm runs it again and again on one ledger, whose nodes stay
// in the caches; cold takes 64 such ledgers in turn (tens of megabytes),
// so that each finds its own out of the caches, as a router does after a
// turn's other work.
func BenchmarkAddReturnPrefix(b *testing.B) {
	for _, ledgers := range []int{1, 64} {
		name := map[int]string{1: "warm", 64: "cold"}[ledgers]
		b.Run(name, func(b *testing.B) {
			var bus []*budget.Budget
			var hashes [][]byte
			for range ledgers {
				bu, h := prefixEngine(b, 64)
				bus, hashes = append(bus, bu), append(hashes, h)
			}
			now := t0.Add(time.Minute)
			key := keyOf(1 << 20)
			f := budget.Features{Class: "acme/qwen3", Turn: 2}
			b.ReportAllocs()
			for i := 0; b.Loop(); i++ {
				bu, h := bus[i%ledgers], hashes[i%ledgers]
				now = now.Add(time.Microsecond)
				if err := bu.Add(budget.Hold{Key: key, Engine: "d0", Tokens: 100_000, Created: now, Expires: now.Add(ttl), Features: f,
					Saved: time.Second, Prefix: fpPrefix(h), PrefixBlockSize: 16}); err != nil {
					b.Fatal(err)
				}
				bu.Return(key, now.Add(time.Second))
			}
			if u := bus[0].Usage(now)[0]; u.Holds != 64 {
				b.Fatal(u.Holds)
			}
		})
	}
}

// BenchmarkVictimsPrefix chooses a victim among 64 holds of 100,000
// tokens with their Prefix on an engine just over its budget (as
// BenchmarkVictims): each hold's value is per block its release frees.
func BenchmarkVictimsPrefix(b *testing.B) {
	const convs = 64
	// Room for the distinct blocks of convs holds: one more goes over.
	bu, _ := prefixEngine(b, convs, budget.WithFraction(1), budget.WithCapacity(convs*(100_000-4096)+4096+convs*16))
	now := t0.Add(time.Minute)
	b.ReportAllocs()
	for i := 0; b.Loop(); i++ {
		now = now.Add(time.Microsecond)
		if err := bu.Add(budget.Hold{Key: keyOf(convs + i), Engine: "d0", Tokens: 100_000, Created: now, Expires: now.Add(ttl),
			Saved: time.Second, Prefix: famBlocks{100_000 / 16, 4096 / 16, uint64(convs + i + 1)}, PrefixBlockSize: 16}); err != nil {
			b.Fatal(err)
		}
		if vs := bu.Victims("d0", 0, now); len(vs) != 1 {
			b.Fatal(len(vs))
		}
	}
}

// BenchmarkPlaced is a turn's residency lookup on a busy decode engine:
// 20,000 placements in the horizon (2,000 tokens each, every fourth
// superseding its conversation's last), a 416k-token tier: the count of
// what later turns touched stops at the tier's capacity, so a lookup
// reads at most about capacity / tokens accesses whatever the horizon
// holds.
func BenchmarkPlaced(b *testing.B) {
	l, err := budget.New(budget.WithHorizon(time.Hour))
	if err != nil {
		b.Fatal(err)
	}
	l.SetCPUTier(416_000)
	const n = 20_000
	keys := make([]string, n)
	for i := range keys {
		keys[i] = fmt.Sprintf("turn-%d", i)
		p := budget.Placement{Prefill: "http://p", Decode: "http://d", Tokens: 2000}
		if i%4 == 3 {
			p.Prior = keys[i-1]
		}
		l.SetPlaced(keys[i], p, t0)
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; b.Loop(); i++ {
		if _, _, ok := l.Placed(keys[i%n], t0); !ok {
			b.Fatal("no record")
		}
	}
}
