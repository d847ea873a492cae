package redisstore

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
)

// GoRedisLog writes go-redis's own log lines (a failed dial, a Sentinel's
// new primary) as slog records, so that they follow the program's log
// format and level instead of going to stderr as unstructured text.
// go-redis has one logger per process: a program installs it once, in
// main, with redis.SetLogger(redisstore.NewGoRedisLog(logger)); this
// package never does.
//
// Records are at debug level: while Redis is down go-redis writes a line
// per failed dial, and the Store already reports each outage once at warn
// level. The message is "go-redis"; the attribute msg holds go-redis's
// text (without its "redis: " prefix). Safe for concurrent use.
type GoRedisLog struct {
	l *slog.Logger
}

// NewGoRedisLog returns a GoRedisLog that writes to l; nil l discards.
func NewGoRedisLog(l *slog.Logger) *GoRedisLog {
	if l == nil {
		l = slog.New(slog.DiscardHandler)
	}
	return &GoRedisLog{l: l}
}

// Printf implements go-redis's logging interface.
func (g *GoRedisLog) Printf(ctx context.Context, format string, v ...any) {
	if !g.l.Enabled(ctx, slog.LevelDebug) {
		return
	}
	msg := strings.TrimPrefix(fmt.Sprintf(format, v...), "redis: ")
	g.l.LogAttrs(ctx, slog.LevelDebug, "go-redis", slog.String("msg", msg))
}
