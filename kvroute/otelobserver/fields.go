package otelobserver

import (
	"reflect"
	"time"

	"go.opentelemetry.io/otel/attribute"

	"github.com/bidikv/bidikv/internal/turnfields"
	"github.com/bidikv/bidikv/kvroute"
)

// withAttr is the turn-record keys that endTurn sets under an attribute of
// their own (the Attr constants); every other field of the record is set
// as "bidikv.<key>" (durations "bidikv.<key>_ms"), when its turn tag shows
// it, so that a new field of the record reaches the spans by its tag.
var withAttr = map[string]bool{
	"request_id": true, "path": true, "stream": true, "reuse": true, "reusable_tokens": true, "stored": true,
	"bytes": true, "miss_reason": true, "released": true, "verification": true, "verified_tokens": true,
	"handle_tokens": true, "prompt_tokens": true, "cached_tokens": true, "token_source": true, "partial": true,
	"unconfirmed": true, "handle_age": true, "prefill_endpoint": true, "prefill_attempts": true,
	"decode_endpoint": true, "first_byte": true, "ttft": true, "local_fallback": true, "no_handle": true,
	"store_refusal": true, "phase": true, "err": true,
}

// recordFields sets the record's other fields on the turn's span.
type recordFields struct {
	tb *turnfields.Table
}

func newRecordFields() (recordFields, error) {
	tb, err := turnfields.For(reflect.TypeFor[kvroute.TurnRecord]())
	return recordFields{tb}, err
}

func (rf recordFields) attrs(dst []attribute.KeyValue, rec *kvroute.TurnRecord) []attribute.KeyValue {
	rf.tb.Each(rec, func(f *turnfields.Field, v turnfields.Value) {
		if withAttr[f.Key] || !turnfields.Shown(f, v) {
			return
		}
		key := "bidikv." + f.Key
		switch f.Kind {
		case turnfields.Flag:
			dst = append(dst, attribute.Bool(key, v.Bool()))
		case turnfields.Count:
			dst = append(dst, attribute.Int64(key, v.Int()))
		case turnfields.Duration:
			dst = append(dst, attribute.Float64(key+"_ms", float64(v.Duration())/float64(time.Millisecond)))
		default:
			dst = append(dst, attribute.String(key, v.String()))
		}
	})
	return dst
}
