package jsonraw

import (
	"strconv"
	"strings"
	"testing"
)

// FuzzDuplicate: Duplicate finds, through its table, the member that
// comparing each name with every earlier one finds.
func FuzzDuplicate(f *testing.F) {
	many := make([]string, 70)
	for i := range many {
		many[i] = `"k` + strconv.Itoa(i%40) + `":1`
	}
	for _, s := range []string{`{}`, `{"a":1,"b":2,"a":3}`, `{"a":1,"\u0061":2}`, "{\"\xff\":1,\"\\ufffd\":2}", `{"a":1,"b":1,"b":2,"a":2}`,
		`{` + strings.Join(many[:60], ",") + `}`, `{` + strings.Join(many, ",") + `}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		o, err := Parse(data)
		if err != nil {
			return
		}
		k, dup := o.Duplicate()
		wk, wdup := o.duplicateEach()
		if k != wk || dup != wdup {
			t.Fatalf("Duplicate %q %v, each with every earlier %q %v", k, dup, wk, wdup)
		}
	})
}
