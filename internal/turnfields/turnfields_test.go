package turnfields_test

import (
	"bytes"
	"errors"
	"log/slog"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/internal/turnfields"
	"github.com/bidikv/bidikv/kvroute"
)

// Every exported field of kvroute.TurnRecord declares how it is shown: a
// field added without a tag, or with a kind that does not fit, fails here.
func TestTurnRecordTagged(t *testing.T) {
	tb, err := turnfields.For(reflect.TypeFor[kvroute.TurnRecord]())
	require.NoError(t, err)
	rt := reflect.TypeFor[kvroute.TurnRecord]()
	exported := 0
	for i := range rt.NumField() {
		if rt.Field(i).IsExported() {
			exported++
		}
	}
	assert.Len(t, tb.Fields, exported, "every exported field is shown")
	for _, f := range tb.Fields {
		assert.Regexp(t, `^[a-z][a-z0-9_]*$`, f.Key, f.Name)
	}
}

func TestForRefusesBadTags(t *testing.T) {
	type noTag struct {
		A string `turn:"a,id"`
		B int
	}
	type badKind struct {
		A string `turn:"a,words"`
	}
	type misfit struct {
		A time.Duration `turn:"a,count"`
	}
	type misfitFlag struct {
		A string `turn:"a,flag"`
	}
	type twice struct {
		A string `turn:"a,id"`
		B string `turn:"a,enum"`
	}
	type badOption struct {
		A string `turn:"a,id,sometimes"`
	}
	type noKind struct {
		A string `turn:"a"`
	}
	for name, v := range map[string]any{
		"no tag": noTag{}, "unknown kind": badKind{}, "duration as count": misfit{}, "string as flag": misfitFlag{},
		"key twice": twice{}, "unknown option": badOption{}, "no kind": noKind{}, "not a struct": 3,
	} {
		_, err := turnfields.For(reflect.TypeOf(v))
		assert.Error(t, err, name)
	}
	type ok struct {
		A      string        `turn:"a,id,always"`
		B      bool          `turn:"b,flag"`
		C      int64         `turn:"c,count"`
		D      time.Duration `turn:"d,duration"`
		E      error         `turn:"e,error"`
		Hidden int           `turn:"-"`
		hidden int
	}
	tb, err := turnfields.For(reflect.TypeFor[*ok]())
	require.NoError(t, err)
	assert.Len(t, tb.Fields, 5)
	_ = ok{}.hidden
}

// Logs show always-shown fields and every set one, with its kind's value.
func TestAttrs(t *testing.T) {
	tb, err := turnfields.For(reflect.TypeFor[kvroute.TurnRecord]())
	require.NoError(t, err)

	var buf bytes.Buffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	rec := &kvroute.TurnRecord{RequestID: "r1", Partial: true, VerifiedTokens: 96, Render: 3 * time.Millisecond,
		Err: errors.New("boom"), ErrPhase: kvroute.PhaseDecode}
	log.LogAttrs(t.Context(), slog.LevelInfo, "turn", tb.Attrs(nil, rec)...)
	line := buf.String()
	for _, want := range []string{"request_id=r1", "partial=true", "verified_tokens=96", "render=3ms", "err=boom",
		"phase=decode", "reuse=\"\"", "stored=false", "ttft=0s"} {
		assert.Contains(t, line, want)
	}
	for _, absent := range []string{"unconfirmed=", "token_source=", "released="} {
		assert.NotContains(t, line, absent, "zero and not always shown")
	}

	all := &kvroute.TurnRecord{}
	tb.SetAll(all)
	buf.Reset()
	log.LogAttrs(t.Context(), slog.LevelInfo, "turn", tb.Attrs(nil, all)...)
	for _, f := range tb.Fields {
		assert.True(t, strings.Contains(buf.String(), " "+f.Key+"="), f.Key)
	}
	assert.Panics(t, func() { tb.Each(&struct{}{}, func(*turnfields.Field, turnfields.Value) {}) })
}
