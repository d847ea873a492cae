package kvroute

import (
	"context"
	"log/slog"
	"sync"
)

// logger is the Router's logger (WithLogger): it never logs prompts,
// bodies or credentials, and a warning that would repeat on every turn is
// logged once per key.
type logger struct {
	*slog.Logger
	seen sync.Map // once's keys
}

// once logs msg at warning level the first time key is seen.
func (l *logger) once(ctx context.Context, key, msg string, attrs ...slog.Attr) {
	if _, loaded := l.seen.LoadOrStore(key, struct{}{}); loaded {
		return
	}
	l.LogAttrs(ctx, slog.LevelWarn, msg, attrs...)
}
