package redisstore

import (
	"context"
	"errors"
	"log/slog"
	"strings"

	"github.com/redis/go-redis/v9"
)

// takeScript is GETDEL for servers without it: Redis runs a script
// atomically, so no other client sees the value between GET and DEL.
const takeScript = `local v = redis.call('GET', KEYS[1])
if v then redis.call('DEL', KEYS[1]) end
return v`

// take runs GETDEL, or the script once the server has said that it does not
// know GETDEL. An unknown command did nothing on the server, so running the
// script after it cannot hand the value out twice.
func (s *Store) take(ctx context.Context, key string) ([]byte, error) {
	if !s.useScript.Load() {
		v, err := s.client.GetDel(ctx, key).Bytes()
		if err == nil || errors.Is(err, redis.Nil) || !unknownCommand(err) {
			return v, err
		}
		if s.useScript.CompareAndSwap(false, true) {
			// The error quotes the command's arguments, the key among
			// them: say what happened without it.
			s.log.LogAttrs(ctx, slog.LevelInfo, "redisstore: the server does not know GETDEL; taking with a Lua script from now on")
		}
	}
	v, err := s.script.Run(ctx, s.client, []string{key}).Text()
	if err != nil {
		return nil, err
	}
	return []byte(v), nil
}

// unknownCommand reports whether err is the server's answer to a command it
// does not know (a Redis before 6.2, a command renamed away, some proxies).
func unknownCommand(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.Contains(strings.ToLower(re.Error()), "unknown command")
}
