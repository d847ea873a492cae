package otelobserver

import (
	"context"
	"reflect"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"

	"github.com/bidikv/bidikv/internal/turnfields"
	"github.com/bidikv/bidikv/kvroute"
)

// Every field of the turn record, today's and any added later with its
// tag, reaches the turn's span: under an Attr constant of its own or as
// "bidikv.<key>" from its tag.
func TestRecordFieldsOnSpan(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	defer func() { _ = tp.Shutdown(context.Background()) }()
	o, err := New(WithTracerProvider(tp))
	require.NoError(t, err)

	tb, err := turnfields.For(reflect.TypeFor[kvroute.TurnRecord]())
	require.NoError(t, err)
	keys := map[string]bool{}
	for _, f := range tb.Fields {
		keys[f.Key] = true
	}
	for k := range withAttr {
		assert.True(t, keys[k], "withAttr names %q, no field of the record", k)
	}

	rec := &kvroute.TurnRecord{}
	tb.SetAll(rec)
	rec.Verification = kvroute.VerifyTokens
	_, end := o.StartTurn(context.Background(), &kvroute.Request{Path: kvroute.PathChatCompletions})
	end(rec)
	spans := exp.GetSpans()
	require.Len(t, spans, 1)
	got := map[string]bool{}
	for _, kv := range spans[0].Attributes {
		got[string(kv.Key)] = true
	}
	for _, f := range tb.Fields {
		if withAttr[f.Key] {
			continue
		}
		key := "bidikv." + f.Key
		if f.Kind == turnfields.Duration {
			key += "_ms"
		}
		assert.True(t, got[key], "span lacks %s (has %s)", key, strings.Join(keysOf(got), " "))
	}
}

func keysOf(m map[string]bool) []string {
	var ks []string
	for k := range m {
		ks = append(ks, k)
	}
	return ks
}
