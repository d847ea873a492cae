package redisstore_test

import (
	"context"
	"log/slog"
	"sync"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/bidikv/bidikv/retention/redisstore"
)

// logRecorder is a slog.Handler that keeps every record.
type logRecorder struct {
	mu      sync.Mutex
	records []slog.Record
}

func (r *logRecorder) Enabled(context.Context, slog.Level) bool { return true }

func (r *logRecorder) Handle(_ context.Context, rec slog.Record) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.records = append(r.records, rec.Clone())
	return nil
}

func (r *logRecorder) WithAttrs([]slog.Attr) slog.Handler { return r }
func (r *logRecorder) WithGroup(string) slog.Handler      { return r }

// messages returns the level and message of every record so far.
func (r *logRecorder) messages() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := make([]string, len(r.records))
	for i, rec := range r.records {
		out[i] = rec.Level.String() + " " + rec.Message
	}
	return out
}

// attr returns the value of attribute key in record i, or nil.
func (r *logRecorder) attr(i int, key string) any {
	r.mu.Lock()
	defer r.mu.Unlock()
	var v any
	r.records[i].Attrs(func(a slog.Attr) bool {
		if a.Key == key {
			v = a.Value.Any()
			return false
		}
		return true
	})
	return v
}

// GoRedisLog turns go-redis's log lines into structured records at debug
// level, without go-redis's own prefix.
func TestGoRedisLog(t *testing.T) {
	rec := &logRecorder{}
	g := redisstore.NewGoRedisLog(slog.New(rec))
	g.Printf(context.Background(), "redis: connection pool: failed to dial after %d attempts: %v", 5, "connection refused")
	g.Printf(context.TODO(), "sentinel: new master=%q addr=%q", "m", "10.0.0.1:6379")
	require.Equal(t, []string{"DEBUG go-redis", "DEBUG go-redis"}, rec.messages())
	assert.Equal(t, "connection pool: failed to dial after 5 attempts: connection refused", rec.attr(0, "msg"))
	assert.Equal(t, `sentinel: new master="m" addr="10.0.0.1:6379"`, rec.attr(1, "msg"))
	redisstore.NewGoRedisLog(nil).Printf(context.Background(), "discarded")
}
