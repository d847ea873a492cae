package redisstore

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

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
	if s.replicas > 0 {
		return s.takeReplicated(ctx, key)
	}
	if !s.useScript.Load() {
		v, err := s.client.GetDel(ctx, key).Bytes()
		if err == nil || errors.Is(err, redis.Nil) || !unknownCommand(err) {
			return v, err
		}
		s.switchToScript(ctx)
	}
	v, err := s.script.Run(ctx, s.client, []string{key}).Text()
	if err != nil {
		return nil, err
	}
	return []byte(v), nil
}

// switchToScript makes every later take use the script, logging the switch
// once.
func (s *Store) switchToScript(ctx context.Context) {
	if s.useScript.CompareAndSwap(false, true) {
		// The error quotes the command's arguments, the key among them:
		// say what happened without it.
		s.log.LogAttrs(ctx, slog.LevelInfo, "redisstore: the server does not know GETDEL; taking with a Lua script from now on")
	}
}

// takeReplicated is take followed by WAIT on the same connection to the
// key's primary: the value is returned only if s.replicas replicas
// acknowledged the delete.
func (s *Store) takeReplicated(ctx context.Context, key string) ([]byte, error) {
	var node *redis.Client
	if s.cluster != nil {
		// WAIT names no key: a cluster client would send it to every
		// primary, not down the connection that ran GETDEL.
		var err error
		if node, err = s.cluster.MasterForKey(ctx, key); err != nil {
			return nil, err
		}
	} else {
		node = s.client.(*redis.Client) // newStore checked
	}
	for {
		script := s.useScript.Load()
		pipe := node.Pipeline()
		var take func() ([]byte, error)
		if script {
			c := s.script.Eval(ctx, pipe, []string{key})
			take = func() ([]byte, error) { v, err := c.Text(); return []byte(v), err }
		} else {
			take = pipe.GetDel(ctx, key).Bytes
		}
		wait := pipe.Do(ctx, "wait", s.replicas, waitBudget(ctx).Milliseconds())
		_, _ = pipe.Exec(ctx) // each command holds its own error
		v, err := take()
		if err != nil {
			if !script && unknownCommand(err) {
				s.switchToScript(ctx)
				continue // the script now; the unknown GETDEL did nothing
			}
			return nil, err
		}
		n, err := wait.Int64()
		if err == nil && n < int64(s.replicas) {
			err = fmt.Errorf("%d of %d replicas acknowledged it in time", n, s.replicas)
		}
		if err != nil {
			s.counters.unreplicated.Add(1)
			return nil, fmt.Errorf("%w: %w", ErrNotReplicated, err)
		}
		return v, nil
	}
}

// waitBudget is WAIT's timeout: half of what is left of ctx, so that the
// answer arrives before the deadline, and at least a millisecond (WAIT 0
// would block until the replicas answer, however long).
func waitBudget(ctx context.Context) time.Duration {
	d := time.Second
	if dl, ok := ctx.Deadline(); ok {
		d = time.Until(dl) / 2
	}
	return max(d, time.Millisecond)
}

// unknownCommand reports whether err is the server's answer to a command it
// does not know (a Redis before 6.2, a command renamed away, some proxies).
func unknownCommand(err error) bool {
	var re redis.Error
	return errors.As(err, &re) && strings.Contains(strings.ToLower(re.Error()), "unknown command")
}
