package budget

import (
	"encoding/binary"
	"testing"
	"time"
)

// blocks is a prefix of n blocks whose identities are their index, chained
// by a constant (enough for the codec: it reads the sampled positions).
type blocks int

func (b blocks) Len() int        { return int(b) }
func (b blocks) At(i int) uint64 { return uint64(i)*0x9e3779b97f4a7c15 + 1 }

// A journal record is bytes another process (or anything that can write
// to the store) put there: decoding any input never panics, a record
// that decodes re-encodes to one that decodes the same, and applying any
// input to a ledger never panics and leaves it answering.
func FuzzJournalRecord(f *testing.F) {
	t0 := time.Unix(1_700_000_000, 0)
	h := Hold{Key: "k", Engine: "http://d", Tokens: 25_000, Created: t0, Expires: t0.Add(480 * time.Second),
		Features: Features{Class: "c", Turn: 3, ToolCalls: true}, Saved: time.Second, Owner: "tenant"}
	f.Add(encodeAdd("a", h, blocks(25_000/16), 16))
	f.Add(encodeAdd("a", h, nil, 0))
	f.Add(encodeEnd(kindReturn, "a", "k", t0.UnixNano(), t0.Add(time.Minute).UnixNano()))
	f.Add(encodeEnd(kindEnd, "a", "k", 0, t0.UnixNano()))
	f.Add(encodeCapacity("a", "http://d", 200_000, 16))
	f.Add(encodeRunning("a", t0.Add(10*time.Second).UnixNano(), map[string]int64{"http://d": 4096, "http://e": 1}))
	f.Add(encodePrefilled("a", "k", Placement{Prefill: "http://p"}, false, t0.UnixNano()))
	f.Add(encodePrefilled("a", "k", Placement{}, true, t0.UnixNano()))
	f.Add(encodePrefilled("a", "k", Placement{Prefill: "http://p", Decode: "http://d", Tokens: 4096, Prior: "j"}, false, t0.UnixNano()))
	f.Add(oldPlaced(6000))
	// A count of engines far past the record's bytes: it hung the decoder
	// (4 billion turns of a loop) before the count was checked.
	f.Add([]byte{recordVersion, kindRunning, 1, 'a', 2, 0xff, 0xff, 0xff, 0xff, 0x0f})
	f.Fuzz(func(t *testing.T, raw []byte) {
		rc, err := decode(raw)
		if err == nil {
			var again []byte
			switch rc.kind {
			case kindReturn, kindEnd:
				again = encodeEnd(rc.kind, rc.source, rc.key, rc.created, rc.at)
			case kindCapacity:
				again = encodeCapacity(rc.source, rc.engine, rc.cap.Tokens, rc.cap.BlockSize)
			case kindPrefilled:
				again = encodePrefilled(rc.source, rc.key, rc.placed, rc.freed, rc.at)
			}
			if again != nil {
				rc2, err := decode(again)
				if err != nil {
					t.Fatalf("re-encoded %+v does not decode: %v", rc, err)
				}
				if rc2.kind != rc.kind || rc2.source != rc.source || rc2.key != rc.key || rc2.engine != rc.engine ||
					rc2.created != rc.created || rc2.at != rc.at || rc2.cap != rc.cap || rc2.freed != rc.freed || rc2.placed != rc.placed {
					t.Fatalf("round trip: %+v became %+v", rc, rc2)
				}
			}
		}
		b, err := New(WithJournal(&MemoryJournal{}, "me"), WithCapacity(1<<20))
		if err != nil {
			t.Fatal(err)
		}
		b.mu.Lock()
		b.apply(raw, t0.UnixNano())
		b.mu.Unlock()
		now := t0.Add(time.Minute)
		for _, e := range []string{"http://d", rc.engine, rc.hold.Engine} {
			if held, _ := b.Held(e, now); held < 0 {
				t.Fatalf("held %d on %q", held, e)
			}
			b.Victims(e, 1, now)
		}
		b.Prefilled(rc.key, now)
		if _, after, _ := b.Placed(rc.key, now); after < 0 {
			t.Fatalf("placed after %d", after)
		}
		if st := b.Stats(); st.Holds < 0 {
			t.Fatalf("stats %+v", st)
		}
	})
}

// oldPlaced is a placement record as the version before Prior wrote it:
// its last field a count of written tokens.
func oldPlaced(written uint64) []byte {
	b := encodePrefilled("a", "k", Placement{Prefill: "http://p", Decode: "http://d", Tokens: 8000}, false, time.Unix(1_700_000_000, 0).UnixNano())
	return binary.AppendUvarint(b[:len(b)-1], written) // the empty Prior's length byte, replaced
}

// A placement record of the version before Prior (a process not yet
// upgraded) keeps its engines and tokens, without a Prior, rather than
// being refused as invalid.
func TestDecodeOldPlaced(t *testing.T) {
	for _, w := range []uint64{0, 5, 6000, 1 << 40} {
		rc, err := decode(oldPlaced(w))
		if err != nil {
			t.Fatalf("written %d: %v", w, err)
		}
		if want := (Placement{Prefill: "http://p", Decode: "http://d", Tokens: 8000}); rc.placed != want {
			t.Fatalf("written %d: %+v, want %+v", w, rc.placed, want)
		}
	}
	rc, err := decode(encodePrefilled("a", "k", Placement{Prefill: "http://p", Decode: "http://d", Tokens: 8000, Prior: "j"}, false, 1))
	if err != nil || rc.placed.Prior != "j" {
		t.Fatalf("this version's record: %+v, %v", rc.placed, err)
	}
}
