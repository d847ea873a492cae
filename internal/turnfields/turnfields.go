// Package turnfields reads a turn record's fields from one declaration:
// the `turn` struct tag of each field of kvroute.TurnRecord. The proxy's
// log, its /metrics and the OpenTelemetry observer derive what they show
// from it, so that a new field of the record is one line (the field and
// its tag) and appears in all three.
//
// A tag is `turn:"key,kind"` or `turn:"key,kind,always"`: key is the
// snake_case name the field is shown under (a log key, a trace attribute
// "bidikv.<key>", a metric label value); kind says what the field is and
// therefore where it may go (Kind); always shows it even when zero (in
// logs and traces; metrics count only what happened). A field tagged "-"
// is not shown; an exported field without a tag is an error of For, so
// that no field is forgotten.
package turnfields

import (
	"fmt"
	"log/slog"
	"reflect"
	"strings"
	"time"
)

// Kind is what a field holds, which decides where it is shown.
type Kind uint8

// Kinds. IDs and errors are free-form: logs and traces only, never a
// metric label. Enums have few values: a metric label too. Flags are
// counted when true, counts summed, durations observed in seconds.
const (
	ID Kind = iota + 1
	Enum
	Flag
	Count
	Duration
	Error
)

var kinds = map[string]Kind{"id": ID, "enum": Enum, "flag": Flag, "count": Count, "duration": Duration, "error": Error}

// Field is one shown field of a record type.
type Field struct {
	Key    string // snake_case name
	Name   string // the Go field's name
	Kind   Kind
	Always bool // shown in logs and traces even when zero
	index  int
}

// Table is the shown fields of one struct type, in declaration order.
type Table struct {
	typ    reflect.Type
	Fields []Field
}

// For reads the tags of struct type t (or a pointer to it). It fails on
// an exported field without a tag, an unknown kind, a kind that does not
// fit the field's type, or a key used twice.
func For(t reflect.Type) (*Table, error) {
	if t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct {
		return nil, fmt.Errorf("turnfields: %s is not a struct", t)
	}
	tb := &Table{typ: t}
	seen := map[string]bool{}
	for i := range t.NumField() {
		sf := t.Field(i)
		if !sf.IsExported() {
			continue
		}
		tag, ok := sf.Tag.Lookup("turn")
		if !ok {
			return nil, fmt.Errorf("turnfields: %s.%s has no turn tag", t.Name(), sf.Name)
		}
		if tag == "-" {
			continue
		}
		f, err := parse(sf, tag)
		if err != nil {
			return nil, fmt.Errorf("turnfields: %s.%s: %w", t.Name(), sf.Name, err)
		}
		if seen[f.Key] {
			return nil, fmt.Errorf("turnfields: %s.%s: key %q used twice", t.Name(), sf.Name, f.Key)
		}
		seen[f.Key] = true
		f.index = i
		tb.Fields = append(tb.Fields, f)
	}
	return tb, nil
}

func parse(sf reflect.StructField, tag string) (Field, error) {
	parts := strings.Split(tag, ",")
	if len(parts) < 2 || len(parts) > 3 || parts[0] == "" {
		return Field{}, fmt.Errorf("tag %q: want key,kind[,always]", tag)
	}
	k, ok := kinds[parts[1]]
	if !ok {
		return Field{}, fmt.Errorf("tag %q: unknown kind %q", tag, parts[1])
	}
	f := Field{Key: parts[0], Name: sf.Name, Kind: k}
	if len(parts) == 3 {
		if parts[2] != "always" {
			return Field{}, fmt.Errorf("tag %q: unknown option %q", tag, parts[2])
		}
		f.Always = true
	}
	if !fits(k, sf.Type) {
		return Field{}, fmt.Errorf("kind %s does not fit type %s", parts[1], sf.Type)
	}
	return f, nil
}

var durationType = reflect.TypeFor[time.Duration]()

func fits(k Kind, t reflect.Type) bool {
	switch k {
	case ID, Enum:
		return t.Kind() == reflect.String
	case Flag:
		return t.Kind() == reflect.Bool
	case Count:
		return t != durationType && (t.Kind() == reflect.Int || t.Kind() == reflect.Int64)
	case Duration:
		return t == durationType
	case Error:
		return t.Kind() == reflect.Interface && t.Implements(reflect.TypeFor[error]())
	}
	return false
}

// Value is one field's value in a record.
type Value struct {
	v reflect.Value
}

// IsZero reports a zero value (false, "", 0, nil).
func (v Value) IsZero() bool { return v.v.IsZero() }

// String is an ID's, an enum's or an error's text ("" for a nil error).
func (v Value) String() string {
	if v.v.Kind() == reflect.Interface {
		if v.v.IsNil() {
			return ""
		}
		return v.v.Interface().(error).Error()
	}
	return v.v.String()
}

// Bool is a flag's value.
func (v Value) Bool() bool { return v.v.Bool() }

// Int is a count's value.
func (v Value) Int() int64 { return v.v.Int() }

// Duration is a duration's value.
func (v Value) Duration() time.Duration { return time.Duration(v.v.Int()) }

// Each calls fn for every field of rec (a pointer to the table's type)
// in declaration order, with its value; shown filters nothing: callers
// decide what a zero means to them (Shown is the logs' and traces' rule).
func (tb *Table) Each(rec any, fn func(f *Field, v Value)) {
	rv := reflect.ValueOf(rec)
	if rv.Kind() == reflect.Pointer {
		rv = rv.Elem()
	}
	if rv.Type() != tb.typ {
		panic(fmt.Sprintf("turnfields: a %s given to the table of %s", rv.Type(), tb.typ))
	}
	for i := range tb.Fields {
		f := &tb.Fields[i]
		fn(f, Value{rv.Field(f.index)})
	}
}

// Shown reports whether logs and traces show the field: always-shown
// fields, and every other field when not zero.
func Shown(f *Field, v Value) bool { return f.Always || !v.IsZero() }

// Attr is the field as a log attribute: durations as durations, errors as
// their text.
func Attr(f *Field, v Value) slog.Attr {
	switch f.Kind {
	case Flag:
		return slog.Bool(f.Key, v.Bool())
	case Count:
		return slog.Int64(f.Key, v.Int())
	case Duration:
		return slog.Duration(f.Key, v.Duration())
	}
	return slog.String(f.Key, v.String())
}

// Attrs appends the log attributes of every shown field of rec.
func (tb *Table) Attrs(dst []slog.Attr, rec any) []slog.Attr {
	tb.Each(rec, func(f *Field, v Value) {
		if Shown(f, v) {
			dst = append(dst, Attr(f, v))
		}
	})
	return dst
}

// SetAll sets every shown field of rec (a pointer to the table's type) to
// a non-zero value of its kind: "x_<key>" for IDs and enums, true, 7, 7 ms,
// an error "x_<key>". Consumers' tests use it to see that every field,
// today's and tomorrow's, reaches what they show.
func (tb *Table) SetAll(rec any) {
	rv := reflect.ValueOf(rec).Elem()
	for _, f := range tb.Fields {
		fv := rv.Field(f.index)
		switch f.Kind {
		case ID, Enum:
			fv.SetString("x_" + f.Key)
		case Flag:
			fv.SetBool(true)
		case Count:
			fv.SetInt(7)
		case Duration:
			fv.SetInt(int64(7 * time.Millisecond))
		case Error:
			fv.Set(reflect.ValueOf(fmt.Errorf("x_%s", f.Key)))
		}
	}
}
