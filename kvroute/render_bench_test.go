package kvroute

import (
	"math/rand/v2"
	"strconv"
	"testing"

	"github.com/bidikv/bidikv/internal/jsonraw"
	"github.com/bidikv/bidikv/kvroute/internal/capture"
)

func seqOf(rng *rand.Rand, n int) []uint32 {
	s := make([]uint32, n)
	for i := range s {
		s[i] = uint32(rng.IntN(150000))
	}
	return s
}

// BenchmarkReadRenderAnswer reads the token ids of a render answer for a
// 24,000-token prompt as renderCall does once its body is read: validate
// the object, take token_ids, parse them into a new slice.
func BenchmarkReadRenderAnswer(b *testing.B) {
	rng := rand.New(rand.NewPCG(9, 10))
	ids := seqOf(rng, 24000)
	body := []byte(`{"token_ids":[`)
	for i, id := range ids {
		if i > 0 {
			body = append(body, ',')
		}
		body = strconv.AppendUint(body, uint64(id), 10)
	}
	body = append(body, "]}"...)
	b.SetBytes(int64(len(body)))
	b.ReportAllocs()
	for b.Loop() {
		o, err := jsonraw.Parse(body)
		if err != nil {
			b.Fatal(err)
		}
		v, _ := o.Get("token_ids")
		got, ok := capture.AppendTokenIDs(nil, v)
		if !ok || len(got) != len(ids) {
			b.Fatalf("ok %v, %d ids", ok, len(got))
		}
	}
}
