package jsonraw_test

import (
	"encoding/json"
	"testing"

	"github.com/bidikv/bidikv/internal/jsonraw"
)

// TestLongStringSpecials: in strings long enough for the scan's
// eight-byte fast path, a quote, a backslash (escape or not), a control
// character or a non-ASCII byte at any offset is judged as encoding/json
// judges it, and the string ends where it does.
func TestLongStringSpecials(t *testing.T) {
	inserts := []string{`"`, `\`, `\n`, `\"`, `\\`, `\u00e9`, `\x`, "\x00", "\x1f", "\x20", "\x7f", "\x80", "\xff", "é", "\t", `\\"`}
	for _, n := range []int{7, 8, 9, 15, 16, 17, 31, 40} {
		for at := 0; at <= n; at++ {
			for _, ins := range inserts {
				plain := make([]byte, n)
				for i := range plain {
					plain[i] = 'a' + byte(i%26)
				}
				s := string(plain[:at]) + ins + string(plain[at:])
				doc := []byte(`{"k":"` + s + `","z":1}`)
				valid := json.Valid(doc)
				if got := jsonraw.Valid(doc); got != valid {
					t.Fatalf("n=%d at=%d insert %q: Valid = %v, json.Valid = %v", n, at, ins, got, valid)
				}
				o, err := jsonraw.Parse(doc)
				if (err == nil) != valid {
					t.Fatalf("n=%d at=%d insert %q: Parse err = %v", n, at, ins, err)
				}
				if err != nil {
					continue
				}
				var want struct{ K string }
				_ = json.Unmarshal(doc, &want)
				v, _ := o.Get("k")
				if got, _ := jsonraw.String(v); got != want.K {
					t.Fatalf("n=%d at=%d insert %q: k = %q, want %q", n, at, ins, got, want.K)
				}
			}
		}
	}
}
